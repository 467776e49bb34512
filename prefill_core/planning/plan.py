"""The planner: a caller's batch -> ordered, immutable ``PrefillRequest``s.

Theory of operation
-------------------
Let ``rung(n)`` be the policy's ladder rung for n tokens (``padded_length``)
and ``bs`` the block size. Each rule is a property in
tests/core/planning/test_plan_properties.py (named after the rule) or
tests/core/planning/test_chunk_rules.py.

1. Every row lands in exactly one request; ``source_rows`` maps back.
2. A row is *regular* iff ``cached == 0`` and ``rung(length) <=
   max_chunk_length``; it runs one step of ``rung(length)`` positions.
   Every other row is *chunked*.
3. Regular rows batch together only when they share a rung and a sampling
   kind (logits or sampled) and the policy allows batching; a wave's padded
   batch is the smallest supported wave >= its active rows; a bucket larger
   than its largest usable wave splits into several waves (and, unless the
   policy pads partial waves, a partial wave splits into exact supported
   sizes), unless ``split_oversize_buckets`` is False. A wave holds at
   least ``min_active_rows`` rows, runs at most ``max_wave_length``
   positions and, sampled, at most ``max_sampled_wave`` rows; with
   ``isolate_cached_buckets`` no row of a rung that a cached row's
   uncached work also has joins a wave (``PrefillPolicy.wave_groups``,
   ``max_wave_for``). Every other row is a sequential single request: a
   planning fallback that changes geometry, never results.
3b. With ``batch_cached_rows``, cached rows whose plan is one step (rule
   4) and that share its start and length form a chunked wave under rule
   3's admission (``min_active_rows``, ``max_wave_length``, ...): each row
   computes exactly what it computes alone, from its own block-aligned
   start, reading its cached prefix through the wave's read table and
   writing no block of it. Rows of a wave share one start: ttnn's chunked
   attention takes one chunk start per call, and with one start no row of a
   wave reads as cached a block another row of it writes.
4. A chunked row's work is ``P = rung(length - start)`` where ``start =
   computed_start(length, cached, bs)`` (``computed_positions``: the start
   of the block holding the cached offset, so a start inside a block
   recomputes that block's cached part). Its chunk length is ``P`` when ``P <=
   max_chunk_length``; otherwise the largest multiple of ``chunk_quantum``
   that is <= ``max_chunk_length`` and divides ``P``; failing that, the
   largest such multiple of ``bs`` (``PrefillPolicy.chunk_length``).
   Chunks start at ``start``, step at absolute positions and stop after
   the chunk holding the last token, so a row computes at most ``P``
   positions and no step is longer than ``max_chunk_length``.
5. A fully cached row (``cached == length``) still owes its last-token
   output: it re-runs its final block, read-only (its fill table is all
   -1), in one step of ``min(rung(bs), max_chunk_length)`` starting at
   the start of the block holding its last token (vLLM recomputes the last
   token the same way).
6. Table widths (``geometry.py``): regular ``table_width(rung(length) /
   bs)``; a chunked row's read table the layout's, ``table_width(ceil(
   (capacity + chunk - 1) / bs))`` whatever its length or cached offset
   (one trace per chunk length), and its fill table ``table_width(chunk /
   bs)``.
7. Output order: batched waves first (by their first source row), then
   singles by source row; then ``block_order.order_writers_first`` moves a
   request that reads as cached a block another request of the call writes
   after that writer (the order is otherwise kept).

Planning reads lengths, offsets and block ids, never token contents, and
its cost grows with rows and mapped blocks, never with tokens.
"""

from __future__ import annotations

from collections import defaultdict

from prefill_core.inputs.batch import PrefillBatch
from prefill_core.inputs.validate import checked_scope
from prefill_core.planning.block_order import order_writers_first
from prefill_core.planning.geometry import chunked_fill_width, chunked_read_width, regular_table_width
from prefill_core.planning.request import PrefillRequest, RequestKind
from prefill_core.values.computed_positions import computed_start
from prefill_core.values.intmath import ceil_div
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy
from prefill_core.values.tables import SKIP, PageTableView, TableRole

__all__ = ["plan_prefill", "plan_geometry", "chunk_plan", "CHUNKED_FILLER"]

CHUNKED_FILLER = 0
"""Block id in unmapped columns of a chunked full-request table (never attended)."""


def plan_prefill(
    batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout, *, max_position: int | None = None
) -> tuple[PrefillRequest, ...]:
    """Plans ``batch``; raises a ``PrefillInputError`` subclass on any bad input.

    ``max_position``: the model's maximum position count; when given, a row
    longer than it raises ``PositionLimitError``.
    """
    needs = checked_scope(batch, policy, layout, max_position=max_position).needs
    return order_writers_first(plan_geometry(batch, needs, policy, layout), layout.block_size)


def plan_geometry(
    batch: PrefillBatch, needs: list[int], policy: PrefillPolicy, layout: PageTableLayout
) -> tuple[PrefillRequest, ...]:
    """Rules 1-6 and the first part of rule 7 over a checked batch (``needs``: each row's mapped block count).

    No writer-before-reader order yet: ``plan_prefill`` orders by
    ``batch.blocks``, a call with one table per KV group by every group's
    (``group_tables``).
    """
    buckets, singles = _bucket_rows(batch, policy)
    cached_buckets = _cached_buckets(batch, policy, layout.block_size, singles)
    waves: list[PrefillRequest] = []
    for (start, padded_length, logits), members in (*buckets.items(), *cached_buckets.items()):
        max_wave = policy.max_wave_for(padded_length, sampled=not logits)
        first = 0
        for size, is_wave in policy.wave_groups(len(members), max_wave):
            group = members[first : first + size]
            first += size
            if not is_wave:
                singles.extend(group)
            elif start is None:
                waves.append(_regular_request(batch, needs, group, padded_length, policy, layout))
            else:
                waves.append(_chunked_request(batch, group, policy, layout))
    waves.sort(key=lambda request: request.source_rows[0])
    singles.sort()
    return tuple(waves) + tuple(_single_request(batch, needs, index, policy, layout) for index in singles)


Bucket = tuple[int | None, int, bool]
"""A wave bucket's key: (shared chunk start or None for regular rows, step length, logits-or-sampled)."""


def _bucket_rows(batch: PrefillBatch, policy: PrefillPolicy) -> tuple[dict[Bucket, list[int]], list[int]]:
    """Regular rows that may batch, by (None, rung, logits-or-sampled); every other row is a single."""
    if not policy.batching_enabled or len(batch) == 1:  # one row has no other to batch with
        return {}, list(range(len(batch)))
    rung_of = {n: policy.padded_length(n) for n in set(batch.lengths)}  # rows share a few lengths: one walk each
    # Rows by (rung, cached, logits-or-sampled), in first-seen order.
    groups: defaultdict[tuple[int, int, bool], list[int]] = defaultdict(list)
    for row, (length, cached, params) in enumerate(zip(batch.lengths, batch.cached, batch.sampling)):
        groups[rung_of[length], cached, params is None].append(row)
    buckets: dict[Bucket, list[int]] = {}
    singles: list[int] = []
    max_chunk = policy.max_chunk_length
    isolated = _cached_rungs(batch, policy) if policy.isolate_cached_buckets else frozenset()
    for (rung, cached, logits), rows in groups.items():
        if cached or rung > max_chunk or rung in isolated:  # rule 2 (PrefillPolicy.is_regular), rule 3
            singles.extend(rows)
        else:
            buckets[None, rung, logits] = rows
    return buckets, singles


def _cached_buckets(
    batch: PrefillBatch, policy: PrefillPolicy, block_size: int, singles: list[int]
) -> dict[Bucket, list[int]]:
    """Cached rows that may share a chunked wave (rule 3b), taken out of ``singles``.

    Rows of one wave share their first chunk start (the start of the block
    holding their cached offset) and their step length, and run in one step:
    ttnn's chunked attention takes one chunk start per call, and one start
    keeps a wave's rows from reading what another row of it writes.
    """
    if not policy.batch_cached_rows or not policy.batching_enabled or len(singles) < 2:
        return {}
    buckets: dict[Bucket, list[int]] = defaultdict(list)
    for row in sorted(singles):  # a wave's rows in caller order, as a regular wave's
        length, cached = batch.lengths[row], batch.cached[row]
        if cached == 0:
            continue
        chunk, start, count = chunk_plan(length, cached, policy, block_size)
        if count == 1:
            buckets[start, chunk, batch.sampling[row] is None].append(row)
    taken = {row for rows in buckets.values() for row in rows}
    singles[:] = [row for row in singles if row not in taken]
    return dict(buckets)


def _cached_rungs(batch: PrefillBatch, policy: PrefillPolicy) -> frozenset[int]:
    """Rungs of the uncached work of the rows that are cached but not fully (``isolate_cached_buckets``)."""
    return frozenset(
        policy.padded_length(length - cached)
        for length, cached in zip(batch.lengths, batch.cached)
        if 0 < cached < length
    )


def _single_request(
    batch: PrefillBatch, needs: list[int], index: int, policy: PrefillPolicy, layout: PageTableLayout
) -> PrefillRequest:
    length, cached = batch.lengths[index], batch.cached[index]
    if policy.is_regular(length, cached):
        return _regular_request(batch, needs, [index], policy.padded_length(length), policy, layout)
    return _chunked_request(batch, [index], policy, layout)


def _pick(column: tuple, members: list[int]) -> tuple:
    """``column``'s entries at ``members`` (the whole column when that is all of it)."""
    if len(members) == len(column):  # members are distinct row indices in order: all rows
        return column
    return tuple(column[i] for i in members)


def _regular_request(
    batch: PrefillBatch,
    needs: list[int],
    members: list[int],
    padded_length: int,
    policy: PrefillPolicy,
    layout: PageTableLayout,
) -> PrefillRequest:
    """A regular wave of ``members``; ``needs`` is every batch row's mapped block count."""
    bs = layout.block_size
    padded_batch = 1 if len(members) == 1 else policy.wave_for(len(members))
    real_blocks = tuple(_pick(needs, members)) + (0,) * (padded_batch - len(members))
    table = PageTableView(TableRole.REGULAR, regular_table_width(policy, bs, padded_length), real_blocks, SKIP)
    return PrefillRequest(
        kind=RequestKind.REGULAR_SINGLE if len(members) == 1 else RequestKind.REGULAR_BATCHED,
        source_rows=tuple(members),
        slots=_pick(batch.slots, members),
        lengths=_pick(batch.lengths, members),
        cached=(0,) * len(members),
        blocks=_pick(batch.blocks, members),
        sampling=_pick(batch.sampling, members),
        padded_batch=padded_batch,
        padded_length=padded_length,
        chunk_length=padded_length,
        block_size=bs,
        first_chunk_start=0,
        num_chunks=1,
        fill_table=table,
        final_fill_table=table,
        read_table=None,
    )


def chunk_plan(length: int, cached: int, policy: PrefillPolicy, block_size: int) -> tuple[int, int, int]:
    """``(chunk length, first start, number of chunks)`` of a chunked row (rules 4 and 5).

    The first start is ``computed_positions.computed_start``: the start of
    the block holding the cached offset (or, fully cached, the last token).
    """
    start = computed_start(length, cached, block_size)
    if cached == length:
        return policy.fully_cached_step(block_size), start, 1
    chunk = policy.chunk_length(policy.padded_length(length - start), block_size)
    # Stop after the chunk holding the last token: arithmetic, never a walk over tokens.
    return chunk, start, ceil_div(length - start, chunk)


def _chunked_request(
    batch: PrefillBatch, members: list[int], policy: PrefillPolicy, layout: PageTableLayout
) -> PrefillRequest:
    """A chunked request of one row, or a one-step wave of rows sharing their start and step (rule 3b)."""
    bs = layout.block_size
    lengths, cached = _pick(batch.lengths, members), _pick(batch.cached, members)
    chunk_length, first_start, num_chunks = chunk_plan(lengths[0], cached[0], policy, bs)
    padded_batch = 1 if len(members) == 1 else policy.wave_for(len(members))
    pad = (0,) * (padded_batch - len(members))
    read_width = chunked_read_width(policy, layout, chunk_length)
    mapped = tuple(ceil_div(n, bs) for n in lengths) + pad
    read_table = PageTableView(TableRole.CHUNKED_FULL, read_width, mapped, CHUNKED_FILLER)
    fill_width = chunked_fill_width(policy, bs, chunk_length)
    final_start = first_start + (num_chunks - 1) * chunk_length
    # What the final step writes: from its start to the row's end; nothing for a fully cached row (read-only).
    final_written = tuple(ceil_div(n - final_start, bs) if c < n else 0 for n, c in zip(lengths, cached)) + pad
    return PrefillRequest(
        kind=RequestKind.CHUNKED,
        source_rows=tuple(members),
        slots=_pick(batch.slots, members),
        lengths=lengths,
        cached=cached,
        blocks=_pick(batch.blocks, members),
        sampling=_pick(batch.sampling, members),
        padded_batch=padded_batch,
        padded_length=max(policy.padded_length(n) for n in lengths),
        chunk_length=chunk_length,
        block_size=bs,
        first_chunk_start=first_start,
        num_chunks=num_chunks,
        fill_table=PageTableView(TableRole.FILL_ONLY, fill_width, (chunk_length // bs,) * len(members) + pad, SKIP),
        final_fill_table=PageTableView(TableRole.FILL_ONLY, fill_width, final_written, SKIP),
        read_table=read_table,
    )
