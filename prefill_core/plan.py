"""The planner: a caller's batch -> ordered, immutable ``PrefillRequest``s.

Rules (each is a property in tests/core/test_plan_properties.py):

1. Every row lands in exactly one request; ``source_rows`` maps back.
2. A wave's padded batch is the smallest supported wave >= its active rows;
   a bucket larger than its largest usable wave splits into several waves
   (and, unless the policy pads partial waves, a partial wave splits into
   exact supported sizes).
3. Rows batch together only when they share a padded length and a sampling
   kind (logits or sampled), are uncached, fit one chunk, and the policy
   allows batching; every other row is a sequential single request. This is
   a planning fallback: it changes geometry, never results.
4. A chunked request is a single row whose length exceeds the max chunk or
   that has a cached prefix. Its chunks start at the cached offset and step by
   the chunk length at absolute positions, stopping after the chunk holding
   the last token. A fully cached row re-runs its final block read-only.
5. Output order: batched waves first (by their first source row), then
   singles by source row.

Planning reads lengths, offsets and block ids, never token contents.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import is_, is_not

from .batch import PrefillBatch, PrefillRow
from .geometry import chunked_fill_width, chunked_read_width, regular_table_width
from .layout import PageTableLayout
from .policy import PrefillPolicy
from .request import PrefillRequest, RequestKind
from .tables import SKIP, PageTableView, TableRole
from .validate import check_inputs

__all__ = ["plan_prefill", "CHUNKED_FILLER"]

CHUNKED_FILLER = 0
"""Block id in unmapped columns of a chunked full-request table (never attended)."""


def plan_prefill(batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout) -> tuple[PrefillRequest, ...]:
    """Plans ``batch``; raises a ``PrefillInputError`` subclass on any bad input."""
    mapped_blocks = check_inputs(batch, policy, layout)
    buckets, singles = _bucket_rows(batch, policy)
    waves: list[PrefillRequest] = []
    for (padded_length, _), members in buckets.items():
        max_wave = policy.max_wave_for(padded_length)
        if len(members) < 2 or max_wave < 2:
            singles.extend(members)
            continue
        for first in range(0, len(members), max_wave):
            rest = members[first : first + max_wave]
            for size in policy.split_wave(len(rest)):
                group, rest = rest[:size], rest[size:]
                if len(group) == 1:
                    singles.append(group[0])
                else:
                    waves.append(_regular_request(batch, mapped_blocks, group, padded_length, policy, layout))
    waves.sort(key=lambda request: request.source_rows[0])
    singles.sort()
    return tuple(waves) + tuple(_single_request(batch, mapped_blocks, index, policy, layout) for index in singles)


def _bucket_rows(batch: PrefillBatch, policy: PrefillPolicy) -> tuple[dict[tuple[int, bool], list[int]], list[int]]:
    """Rows that may batch, by (padded length, logits-or-sampled); the rest are singles."""
    lengths, sampling, n = batch.lengths, batch.sampling, len(batch)
    if not policy.batching_enabled:
        return {}, list(range(n))
    max_chunk = policy.max_chunk_length
    first = lengths[0]
    if first <= max_chunk and lengths == (first,) * n and not any(batch.cached):
        # One length, nothing cached (a uniform wave): at most two buckets, built in C.
        padded = policy.padded_length(first)
        if sampling == (None,) * n or not any(map(is_, sampling, repeat(None))):
            return {(padded, sampling[0] is None): list(range(n))}, []
        logits = list(compress(range(n), map(is_, sampling, repeat(None))))
        return {(padded, True): logits, (padded, False): list(compress(range(n), map(is_not, sampling, repeat(None))))}, []
    buckets: dict[tuple[int, bool], list[int]] = {}
    singles: list[int] = []
    padded_of: dict[int, int] = {}  # rows of a wave usually share lengths: rule once per length
    for index, (length, cached, params) in enumerate(zip(lengths, batch.cached, sampling)):
        if cached == 0 and length <= max_chunk:
            padded = padded_of.get(length)
            if padded is None:
                padded = padded_of[length] = policy.padded_length(length)
            key = (padded, params is None)
            bucket = buckets.get(key)
            if bucket is None:
                buckets[key] = [index]
            else:
                bucket.append(index)
        else:
            singles.append(index)
    return buckets, singles


def _single_request(
    batch: PrefillBatch, mapped_blocks: tuple[int, ...], index: int, policy: PrefillPolicy, layout: PageTableLayout
) -> PrefillRequest:
    length = batch.lengths[index]
    if batch.cached[index] == 0 and length <= policy.max_chunk_length:
        return _regular_request(batch, mapped_blocks, [index], policy.padded_length(length), policy, layout)
    return _chunked_request(batch.row(index), index, policy, layout)


def _pick(column: tuple, members: list[int]) -> tuple:
    """``column``'s entries at ``members`` (the whole column when that is all of it)."""
    if len(members) == len(column):  # members are distinct row indices in order: all rows
        return column
    return tuple(map(column.__getitem__, members))


def _regular_request(
    batch: PrefillBatch,
    mapped_blocks: tuple[int, ...],
    members: list[int],
    padded_length: int,
    policy: PrefillPolicy,
    layout: PageTableLayout,
) -> PrefillRequest:
    bs = layout.block_size
    padded_batch = 1 if len(members) == 1 else policy.wave_for(len(members))
    real_blocks = _pick(mapped_blocks, members) + (0,) * (padded_batch - len(members))
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


def _chunked_request(row: PrefillRow, index: int, policy: PrefillPolicy, layout: PageTableLayout) -> PrefillRequest:
    bs = layout.block_size
    length, cached = row.length, row.cached
    padded_length = policy.padded_length(length)
    chunk_length = policy.chunk_length(padded_length)
    read_width = chunked_read_width(policy, bs, padded_length, chunk_length)
    read_table = PageTableView(TableRole.CHUNKED_FULL, read_width, (-(-length // bs),), CHUNKED_FILLER)
    fill_width = chunked_fill_width(policy, bs, chunk_length)
    # A fully cached row still owes its last-token output: re-run its final
    # block, writing nothing (vLLM recomputes the last token the same way).
    first_start = cached if cached < length else length - bs
    # Chunks step by chunk_length from first_start and stop after the one
    # holding the last token: arithmetic, so the cost never grows with tokens.
    num_chunks = -(-(length - first_start) // chunk_length)
    final_start = first_start + (num_chunks - 1) * chunk_length
    final_written = -(-(length - final_start) // bs) if final_start >= cached else 0
    return PrefillRequest(
        kind=RequestKind.CHUNKED,
        source_rows=(index,),
        slots=(row.slot,),
        lengths=(length,),
        cached=(cached,),
        blocks=(row.blocks,),
        sampling=(row.sampling,),
        padded_batch=1,
        padded_length=padded_length,
        chunk_length=chunk_length,
        block_size=bs,
        first_chunk_start=first_start,
        num_chunks=num_chunks,
        fill_table=PageTableView(TableRole.FILL_ONLY, fill_width, (chunk_length // bs,), SKIP),
        final_fill_table=PageTableView(TableRole.FILL_ONLY, fill_width, (final_written,), SKIP),
        read_table=read_table,
    )
