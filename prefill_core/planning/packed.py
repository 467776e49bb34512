"""Packed steps: a call's real tokens laid end to end, with no padding rows and no padding positions.

Theory of operation
-------------------
A backend that is not bound to fixed shapes (the torch backend: eager on a
CPU) can run a step as row segments ``(row, start, length)`` laid end to end,
as vLLM runs prefill on GPUs. The runtime plans packed steps when the policy
asks for them (``PrefillPolicy.packed_steps``) and the backend and the model
both declare they can run them; ttnn keeps padded waves (``plan.py``).

1. Each row owes the positions ``[cached, length)``. A fully cached row owes
   only its last token, ``[length - 1, length)``, and writes nothing: its
   blocks are cached and may be shared. A segment may start at any position.
2. Rows are packed in caller order, logits rows and sampled rows in separate
   steps (one postprocessing program serves one kind). A row's work fills the
   current step; when a step holds ``policy.max_chunk_length`` tokens the rest
   continues in the next. Cached and uncached rows share steps.
3. A request is a run of steps that ends with the first step in which some row
   ends; its source rows are the rows ending there, and their last tokens are
   its outputs. Every row ends in exactly one request.
4. A segment writes exactly its own positions, through its own row's blocks;
   it reads its row's positions before ``start`` from the pool (the cached
   prefix and the row's earlier segments) and its own fresh K/V.
5. A row that reads as cached a block another row of the call writes (a
   same-step prefix hit, ``block_order``) is packed after that row, so its
   first segment lies in the writer's last step or a later one. A packed
   model writes every segment's K/V of a layer before any segment's
   attention reads the pool, as vLLM's flattened pass does, so a reader in
   the writer's last step reads the writer's fresh K/V.
6. Where the lane's model takes shared writes and the caller's tokens are
   known (``TokenAgreement``), a row that begins with the same tokens as an
   earlier row, over the same blocks before its cached length, computes
   only what follows the agreement (``shared_spans`` rules 1-3); the step
   computing the shared positions writes their K/V into the taker's slots
   too (``PackedStep.shared``).

Identity: a packed program is named by its variant, output rows, token
budget, sampling path and log-probs (``packed_signature``). A step's token
count, segment count and prefix widths are per-step shapes that an eager
program on the CPU does not bake in; a trace would, so packed steps run
eagerly only (docs/design.md, "Packed steps").
"""

from __future__ import annotations

import attrs

from prefill_core.inputs.batch import PrefillBatch
from prefill_core.inputs.validate import check_inputs
from prefill_core.planning.block_order import row_dependencies, rows_writers_first
from prefill_core.planning.request import RequestKind, StepSegment
from prefill_core.planning.shared_spans import SharedRun, SharedWrite, TokenAgreement, shared_runs
from prefill_core.planning.signatures import PrefillProgramSignature
from prefill_core.values.errors import BlockDependencyCycleError
from prefill_core.values.intmath import ceil_div
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy
from prefill_core.values.sampling import SamplingParams, SamplingPath, distinct_params

__all__ = [
    "PackedRequest",
    "PackedStep",
    "owed_positions",
    "packed_signature",
    "plan_packed",
]


@attrs.frozen
class PackedStep:
    """One model-body step: its segments, end to end, and the shared writes of their K/V (rule 6)."""

    segments: tuple[StepSegment, ...]
    shared: tuple[SharedWrite, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(segment.length for segment in self.segments)

    def written_blocks(self, blocks_of: dict[int, tuple[int, ...]], block_size: int) -> dict[int, tuple[int, ...]]:
        """Per caller row with a segment or a shared write here, the blocks this step writes for it
        (``blocks_of``: rows' blocks)."""
        written: dict[int, tuple[int, ...]] = {}
        spans = [(w.row, w.start, w.end) for w in self.shared]  # a row's shared positions precede its own
        spans += [(s.row, s.start, s.end) for s in self.segments if s.writes]
        for row, start, end in sorted(spans):
            # A packed step writes only owed positions, so it writes every block they touch (rule 1).
            blocks = blocks_of[row][start // block_size : ceil_div(end, block_size)]
            written[row] = tuple(dict.fromkeys(written.get(row, ()) + blocks))
        for s in self.segments:
            written.setdefault(s.row, ())
        return written


@attrs.frozen
class PackedRequest:
    """Packed steps up to and including the one where ``source_rows`` end.

    Per-row fields (``source_rows``, ``slots``, ``lengths``, ``cached``,
    ``blocks``, ``sampling``, ``last_token_offsets``) describe the rows whose
    outputs this request returns, as a padded request's do; there are no
    padding rows, so ``padded_batch`` is their count (the request protocol:
    ``request.py``'s module doc). Its steps also compute segments of rows that
    end in a later request (a long row spans requests); ``segment_blocks``
    holds ``(row, blocks)`` for every row with a segment in its steps, so
    ``written_blocks`` names their blocks too.
    """

    source_rows: tuple[int, ...]
    slots: tuple[int, ...]
    lengths: tuple[int, ...]
    cached: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...] = attrs.field(repr=False)
    sampling: tuple[SamplingParams | None, ...]
    steps: tuple[PackedStep, ...]
    last_token_offsets: tuple[int, ...]
    block_size: int
    token_budget: int
    segment_blocks: tuple[tuple[int, tuple[int, ...]], ...] = attrs.field(repr=False)

    kind = RequestKind.PACKED
    read_table = None

    @property
    def padded_batch(self) -> int:
        return len(self.source_rows)

    @property
    def active_batch_size(self) -> int:
        return len(self.source_rows)

    @property
    def num_chunks(self) -> int:
        return len(self.steps)

    @property
    def chunks(self) -> tuple[PackedStep, ...]:
        return self.steps

    @property
    def last_token_positions(self) -> tuple[int, ...]:
        return tuple(length - 1 for length in self.lengths)

    def segments(self, index: int) -> tuple[StepSegment, ...]:
        """Step ``index``'s segments, end to end."""
        return self.steps[index].segments

    def written_blocks(self, index: int) -> dict[int, tuple[int, ...]]:
        """Per caller row with a segment in step ``index``, the blocks that step writes for it."""
        return self.steps[index].written_blocks(dict(self.segment_blocks), self.block_size)

    @property
    def real_tokens(self) -> int:
        """Prompt positions this request's steps fill: those they compute (every one a real token) and those
        shared writes fill (rule 6)."""
        return self.computed_tokens + sum(w.length for step in self.steps for w in step.shared)

    @property
    def computed_tokens(self) -> int:
        """Positions this request's steps compute."""
        return sum(step.tokens for step in self.steps)


def owed_positions(length: int, cached: int) -> tuple[int, int, bool]:
    """``(start, count, writes)`` of the positions a row owes (rule 1)."""
    if cached == length:
        return length - 1, 1, False
    return cached, length - cached, True


def _pack(
    batch: PrefillBatch, rows: list[int], budget: int, first: dict[int, int]
) -> list[tuple[list[StepSegment], list[int]]]:
    """Steps as ``(segments, rows ending in the step)``, rows in the given order (rule 2); ``first``: where a
    row that takes shared positions starts computing (rule 6)."""
    steps: list[tuple[list[StepSegment], list[int]]] = [([], [])]
    used = 0
    for row in rows:
        start, left, writes = owed_positions(batch.lengths[row], batch.cached[row])
        if row in first:
            start, left = first[row], batch.lengths[row] - first[row]
        while left:
            if used == budget:
                steps.append(([], []))
                used = 0
            take = min(left, budget - used)
            steps[-1][0].append(StepSegment(row, used, start, take, writes))
            used, start, left = used + take, start + take, left - take
        steps[-1][1].append(row)
    return steps


def _shared_writes(segments: list[StepSegment], runs: dict[int, list[tuple[int, SharedRun]]]) -> tuple:
    """The shared writes of one step: each run's positions its source computes in ``segments`` (rule 6)."""
    found = []
    for s in segments:
        for row, run in runs.get(s.row, ()):
            start, end = max(run.start, s.start), min(run.end, s.end)
            if start < end:
                found.append(SharedWrite(s.row, row, start, end - start))
    return tuple(found)


def _request(batch: PrefillBatch, steps: list[PackedStep], ending: list[int], budget: int, bs: int) -> PackedRequest:
    final = {s.row: s.offset + s.length - 1 for s in steps[-1].segments if s.row in set(ending)}
    rows = sorted({s.row for step in steps for s in step.segments} | {w.row for step in steps for w in step.shared})
    return PackedRequest(
        source_rows=tuple(ending),
        slots=tuple(batch.slots[r] for r in ending),
        lengths=tuple(batch.lengths[r] for r in ending),
        cached=tuple(batch.cached[r] for r in ending),
        blocks=tuple(batch.blocks[r] for r in ending),
        sampling=tuple(batch.sampling[r] for r in ending),
        steps=tuple(steps),
        last_token_offsets=tuple(final[r] for r in ending),
        block_size=bs,
        token_budget=budget,
        segment_blocks=tuple((r, batch.blocks[r]) for r in rows),
    )


def plan_packed(
    batch: PrefillBatch,
    policy: PrefillPolicy,
    layout: PageTableLayout,
    *,
    max_position: int | None = None,
    agreement: TokenAgreement | None = None,
    read_from: dict[int, int] | None = None,
) -> tuple[PackedRequest, ...]:
    """Plans ``batch`` as packed steps; raises a ``PrefillInputError`` subclass on any bad input.

    ``agreement``: how far the caller's rows agree, where the model takes shared writes (rule 6; None: every
    row computes all it owes); ``read_from``: per row, the first position whose hidden state a hook reads.
    """
    check_inputs(batch, policy, layout, max_position=max_position)
    budget = policy.max_chunk_length
    requests: list[PackedRequest] = []
    for rows in _row_groups(batch, layout.block_size):
        if not rows:
            continue
        taken = {} if agreement is None else shared_runs(batch, rows, layout.block_size, agreement, read_from)
        by_source: dict[int, list[tuple[int, SharedRun]]] = {}
        for row, row_runs in taken.items():
            for run in row_runs:
                by_source.setdefault(run.source, []).append((row, run))
        first = {row: row_runs[-1].end for row, row_runs in taken.items()}
        pending: list[PackedStep] = []
        for segments, ending in _pack(batch, rows, budget, first):
            pending.append(PackedStep(tuple(segments), _shared_writes(segments, by_source)))
            if ending:  # rule 3: a request ends with the first step where a row ends
                requests.append(_request(batch, pending, ending, budget, layout.block_size))
                pending = []
    return tuple(requests)


def _row_groups(batch: PrefillBatch, block_size: int) -> tuple[list[int], list[int]]:
    """Logits rows and sampled rows (rule 2), each writer before the rows reading its blocks (rule 5).

    Logits rows go first unless one of them reads a block a sampled row writes.
    """
    order = rows_writers_first(batch, block_size)
    logits = [r for r in order if batch.sampling[r] is None]
    sampled = [r for r in order if batch.sampling[r] is not None]
    needs = row_dependencies(batch, block_size)
    logits_read_sampled = [r for r in logits if needs[r] & set(sampled)]
    sampled_read_logits = [r for r in sampled if needs[r] & set(logits)]
    if logits_read_sampled and sampled_read_logits:
        row = sampled_read_logits[0]
        msg = (
            f"row {row}: blocks is invalid: it reads as cached a block a logits row writes, and logits row "
            f"{logits_read_sampled[0]} reads one a sampled row writes: packed steps run one kind after the "
            "other, so no order serves both"
        )
        raise BlockDependencyCycleError(msg, row=row, field="blocks")
    return (sampled, logits) if logits_read_sampled else (logits, sampled)


def packed_signature(request: PackedRequest, path: SamplingPath) -> PrefillProgramSignature:
    """The identity of a packed program: output rows, token budget, sampling path, log-probs.

    No table widths: a packed step writes by position and reads per-segment
    prefixes whose widths are per-step data (eager only, see the module doc).
    """
    logprobs = path in (SamplingPath.ARGMAX, SamplingPath.TOPK) and any(
        s is not None and s.num_logprobs > 0 for s in distinct_params(request.sampling)
    )
    return PrefillProgramSignature(RequestKind.PACKED, request.padded_batch, request.token_budget, 0, 0, path, logprobs)
