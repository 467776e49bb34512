"""The ladder tuner: rungs and a max chunk for a length histogram under a trace budget.

Theory of operation
-------------------
A ladder's *cost* on a histogram is the positions the planner computes for
it; its *traces* are the distinct trace signatures those plans use. Both are
measured by planning every entry alone (``measure``): waves depend on how
prompts arrive, not on their lengths, and a wave of k prompts only
multiplies each regular body by its padded batch. So a regular rung used
costs one trace, each chunk length used another (a chunked read table has
the layout's width, ``geometry.py``).

``tune`` searches, for each max chunk ``M`` it may pick (the default's, and
the multiples of the chunk quantum below it: a shorter step computes fewer
wasted positions but runs a device's matmuls at a fraction of their rate,
so it never goes below the quantum), over ladders of two parts:

* work ``w <= M`` (the uncached tokens; the block size for a fully cached
  prompt) runs one step of ``rung(w)``. Rungs are picked among the works
  rounded up to the rung unit, by dynamic programming over their sorted
  values: a rung serves every value above the previous rung, costs its
  value per prompt served, and one trace per kind it serves (regular,
  chunked). For each trace count the cheapest rungs are kept.
* work ``w > M`` runs chunked; one rung at the smallest multiple of ``M``
  that holds the longest such work makes every one of them step by ``M``
  (``ceil(w / M) * M`` positions, one trace).

Every candidate, and the default ladder, is then measured; the fewest
positions within the budget wins (ties: fewer traces, smaller ``M``, fewer
rungs; the default wins an exact tie). The default competes, so a budget at least its trace count never
yields more positions than it.
"""

from __future__ import annotations

import math

import attrs

from prefill_core.inputs.batch import PrefillBatch, PrefillRow
from prefill_core.planning.plan import plan_prefill
from prefill_core.planning.signatures import trace_signature
from prefill_core.tuning.histogram import HistogramEntry
from prefill_core.values.computed_positions import computed_start
from prefill_core.values.errors import PrefillInputError, TraceBudgetError, field_error
from prefill_core.values.intmath import ceil_div, round_up
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy

__all__ = ["LadderCost", "TunedLadder", "measure", "tune"]


@attrs.frozen
class LadderCost:
    """What one policy costs on a histogram: positions computed, real tokens, distinct traces."""

    positions: int
    real_tokens: int
    traces: int

    @property
    def per_real_token(self) -> float:
        return self.positions / self.real_tokens


@attrs.frozen
class TunedLadder:
    """The tuner's pick and the default it was compared with, each with its cost."""

    policy: PrefillPolicy
    cost: LadderCost
    default: PrefillPolicy
    default_cost: LadderCost


def measure(policy: PrefillPolicy, entries: tuple[HistogramEntry, ...], block_size: int) -> LadderCost:
    """``policy``'s cost on ``entries``, each planned alone by the planner (rows numbered in entry order)."""
    rows, block = [], 0
    for slot, entry in enumerate(entries):
        need = ceil_div(entry.length, block_size)
        rows.append(PrefillRow(entry.length, entry.cached, slot, tuple(range(block, block + need))))
        block += need
    longest = max(entry.length for entry in entries)
    layout = PageTableLayout(block_size, ceil_div(longest, block_size), max(block, 1))
    alone = attrs.evolve(policy, batching_enabled=False, lane_size=max(policy.lane_size, len(rows)))
    positions = real = 0
    traces = set()
    for request in plan_prefill(PrefillBatch.from_rows(rows), alone, layout):
        count = entries[request.source_rows[0]].count
        positions += count * request.computed_tokens
        real += count * request.real_tokens
        traces.add(trace_signature(request))
    return LadderCost(positions, real, len(traces))


def _work(entry: HistogramEntry, block_size: int) -> tuple[int, bool]:
    """``(tokens of work, runs chunked)`` of an entry's prompts."""
    if entry.cached == entry.length:
        return block_size, True
    # A padded step starts at the block holding the cached offset (rule 5), as the planner computes it.
    return entry.length - computed_start(entry.length, entry.cached, block_size), entry.cached > 0


def _short_work(
    entries: tuple[HistogramEntry, ...], block_size: int, unit: int, max_chunk: int
) -> tuple[list[int], list[tuple[int, int]], int]:
    """Sorted rung candidates ``<= max_chunk``, their (regular, chunked) prompt counts, and the longest work past it."""
    counts: dict[int, list[int]] = {}
    longest = 0
    for entry in entries:
        work, chunked = _work(entry, block_size)
        if work > max_chunk:
            longest = max(longest, work)
        else:
            counts.setdefault(round_up(work, unit), [0, 0])[chunked] += entry.count
    values = sorted(counts)
    return values, [(counts[v][0], counts[v][1]) for v in values], longest


def _rungs_by_trace_count(values: list[int], counts: list[tuple[int, int]], max_traces: int) -> dict[int, tuple]:
    """For each trace count ``t <= max_traces`` reachable, the cheapest rungs (ending at the largest value)."""
    n = len(values)
    # Each rung serves at most two kinds, so no ladder of these values needs more than 2n traces:
    # a larger budget adds nothing but table size.
    max_traces = min(max_traces, 2 * n)
    prompts, regular, chunked = [0], [0], [0]
    for r, c in counts:
        prompts.append(prompts[-1] + r + c)
        regular.append(regular[-1] + (r > 0))
        chunked.append(chunked[-1] + (c > 0))
    # best[j][t]: (positions, first value index of the last group, traces before it) covering values 0..j
    # with the last rung at values[j] and t traces in all.
    best: list[list[tuple[int, int, int] | None]] = [[None] * (max_traces + 1) for _ in range(n)]
    for j in range(n):
        for i in range(j + 1):
            cost = values[j] * (prompts[j + 1] - prompts[i])
            traces = (regular[j + 1] > regular[i]) + (chunked[j + 1] > chunked[i])
            before = [(0, 0)] if i == 0 else [(t, b[0]) for t, b in enumerate(best[i - 1]) if b is not None]
            for t, paid in before:
                total = t + traces
                if total <= max_traces and (best[j][total] is None or paid + cost < best[j][total][0]):
                    best[j][total] = (paid + cost, i, t)
    choices = {}
    for t, found in enumerate(best[n - 1] if n else ()):
        if found is None:
            continue
        rungs, j, step = [], n - 1, found
        while True:
            rungs.append(values[j])
            _, i, before = step
            if i == 0:
                break
            j, step = i - 1, best[i - 1][before]
        choices[t] = tuple(reversed(rungs))
    return choices


def _max_chunks(policy: PrefillPolicy, entries: tuple[HistogramEntry, ...], block_size: int) -> list[int]:
    """Max chunks the tuner may pick: multiples of the chunk quantum up to the policy's, and the policy's.

    Multiples past the first that holds every entry's rung are left out: from
    there on every entry runs one step of its rung (no chunk is cut shorter),
    so they plan alike, and the tie goes to the smallest. A huge max chunk
    would otherwise be a huge range.
    """
    quantum, limit = policy.chunk_quantum, policy.max_chunk_length
    unit = math.lcm(policy.tile_size, block_size)
    longest = max(entry.length for entry in entries)
    # No candidate ladder's rung, nor a power of two past it, exceeds this for any entry.
    reach = max(1 << (longest - 1).bit_length(), round_up(longest, unit))
    return sorted(set(range(quantum, min(limit, round_up(reach, quantum)) + 1, quantum)) | {limit})


def _candidates(policy: PrefillPolicy, entries: tuple[HistogramEntry, ...], block_size: int, max_traces: int):
    """Every (ladder, max chunk) the search proposes, in a fixed order."""
    unit = math.lcm(policy.tile_size, block_size)
    for max_chunk in _max_chunks(policy, entries, block_size):
        values, counts, longest = _short_work(entries, block_size, unit, max_chunk)
        tail = (ceil_div(longest, max_chunk) * max_chunk,) if longest else ()
        if not values:
            yield tail, max_chunk
            continue
        for rungs in _rungs_by_trace_count(values, counts, max_traces).values():
            yield rungs + tail, max_chunk


def tune(
    entries: tuple[HistogramEntry, ...], *, block_size: int, max_traces: int, default: PrefillPolicy | None = None
) -> TunedLadder:
    """The ladder and max chunk computing the fewest positions on ``entries`` with at most ``max_traces`` traces.

    ``default`` (``PrefillPolicy()``, tt-metal's ladder) is the comparison and
    the base: the pick differs from it only in ``length_ladder`` and a
    ``max_chunk_length`` no larger than its own.
    """
    default = PrefillPolicy() if default is None else default
    if not isinstance(entries, tuple) or not entries or not all(isinstance(e, HistogramEntry) for e in entries):
        rule = "must be a non-empty tuple of HistogramEntry"
        raise field_error(PrefillInputError, "tune", "entries", entries, rule)
    if type(block_size) is not int or block_size <= 0:
        raise field_error(PrefillInputError, "tune", "block_size", block_size, "must be a positive int")
    if type(max_traces) is not int or max_traces < 1:
        raise field_error(TraceBudgetError, "tune", "max_traces", max_traces, "must be a positive int")
    default_cost = measure(default, entries, block_size)
    best = None
    if default_cost.traces <= max_traces:
        key = (default_cost.positions, default_cost.traces, default.max_chunk_length, len(default.length_ladder))
        best = (key, default, default_cost)
    fewest = default_cost.traces
    for ladder, max_chunk in _candidates(default, entries, block_size, max_traces):
        policy = attrs.evolve(default, length_ladder=ladder, max_chunk_length=max_chunk)
        cost = measure(policy, entries, block_size)
        fewest = min(fewest, cost.traces)
        key = (cost.positions, cost.traces, max_chunk, len(ladder))
        if cost.traces <= max_traces and (best is None or key < best[0]):
            best = (key, policy, cost)
    if best is None:
        rule = f"no ladder found within it for this histogram; the fewest traces found is {fewest}"
        raise field_error(TraceBudgetError, "tune", "max_traces", max_traces, rule)
    return TunedLadder(best[1], best[2], default, default_cost)
