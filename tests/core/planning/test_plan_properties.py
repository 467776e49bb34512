"""The planning invariants 1-13 of docs/design.md as properties over generated batches.

Tables are checked as the device gets them (materialized), never as views.
Invariant 3 (identities depend on padded geometry only) lives in
test_signatures.py, invariant 12 (errors) in test_errors.py.
"""

from __future__ import annotations

import attrs
from hypothesis import given

from prefill_core import (
    SKIP,
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillRequest,
    PreparedPrefill,
    RequestKind,
    TableRole,
    from_json,
    plan_prefill,
    prepare_prefill,
    to_json,
)
from prefill_core.values.computed_positions import computed_start, written_columns
from tests.core.plan_checks import expected_writes, source_of, writes_by_source_row
from tests.strategies import cases, fully_cached_cases


def _plan(case):
    return plan_prefill(case.batch, case.policy, case.layout)


def _first_written(row, bs: int) -> int:
    """The row's first written column, or its mapped width when it writes nothing (fully cached)."""
    written = written_columns(row.length, row.cached, bs)
    return written.start if written else -(-row.length // bs)


def _batchable(row, policy: PrefillPolicy) -> bool:
    return policy.batching_enabled and row.cached == 0 and policy.padded_length(row.length) <= policy.max_chunk_length


# ---------------------------------------------------------------- 1. rows and order


@given(cases())
def test_every_row_lands_in_exactly_one_request(case):
    """Each caller row index appears in exactly one request, exactly once."""
    rows = [row for request in _plan(case) for row in request.source_rows]
    assert sorted(rows) == list(range(len(case.batch.rows)))


@given(cases())
def test_source_rows_restore_the_callers_rows(case):
    """Each physical row's per-row fields are those of the caller row ``source_rows`` names."""
    for request in _plan(case):
        for physical, index in enumerate(request.source_rows):
            row = case.batch.rows[index]
            got = (request.lengths[physical], request.cached[physical], request.slots[physical])
            assert got == (row.length, row.cached, row.slot)
            assert request.blocks[physical] == row.blocks
            assert request.sampling[physical] == row.sampling


@given(cases())
def test_requests_are_ordered_waves_first_then_singles_by_row(case):
    """Batched waves come first (by first source row), then single requests by source row."""
    requests = _plan(case)
    kinds = [request.kind is RequestKind.REGULAR_BATCHED for request in requests]
    assert kinds == sorted(kinds, reverse=True)
    waves = [r.source_rows[0] for r in requests if r.kind is RequestKind.REGULAR_BATCHED]
    singles = [r.source_rows[0] for r in requests if r.kind is not RequestKind.REGULAR_BATCHED]
    assert waves == sorted(waves) and singles == sorted(singles)
    for request in requests:
        assert list(request.source_rows) == sorted(request.source_rows)


# ---------------------------------------------------------------- 2. waves


@given(cases())
def test_padded_batch_is_the_smallest_supported_wave(case):
    """A wave pads to the smallest supported wave >= its active rows, within every batching limit."""
    policy = case.policy
    for request in _plan(case):
        active, padded = request.active_batch_size, request.padded_batch
        if request.kind is RequestKind.REGULAR_BATCHED:
            assert 2 <= active <= padded
            assert padded == min(w for w in policy.waves if w >= active)
            assert padded <= min(policy.max_batch_size, policy.lane_size)
            assert padded * request.padded_length < policy.max_batched_tokens
        else:
            assert (active, padded) == (1, 1)


@given(cases())
def test_waves_group_only_batchable_rows_of_one_bucket(case):
    """A wave's rows are uncached, fit one chunk and share padded length and sampling kind."""
    for request in _plan(case):
        if request.kind is not RequestKind.REGULAR_BATCHED:
            continue
        rows = [case.batch.rows[i] for i in request.source_rows]
        assert all(_batchable(row, case.policy) for row in rows)
        assert {case.policy.padded_length(row.length) for row in rows} == {request.padded_length}
        assert len({row.sampling is None for row in rows}) == 1


def _expected_wave_sizes(members: int, policy: PrefillPolicy, padded_length: int) -> list[int]:
    """Model of rule 2: full waves of the largest usable size, then the remainder, padded up as one
    wave or (without ``pad_partial_waves``) split greedily into supported sizes; lone rows run single."""
    largest = policy.max_wave_for(padded_length)
    if members < 2 or largest < 2:
        return []
    sizes = [largest] * (members // largest)
    rest = members % largest
    while rest:
        fitting = [w for w in policy.waves if w <= rest]
        size = rest if policy.pad_partial_waves or not fitting else max(fitting)
        sizes.append(size)
        rest -= size
    return sorted(size for size in sizes if size >= 2)


@given(cases())
def test_a_bucket_splits_into_full_waves_then_its_remainder(case):
    """Each bucket runs full waves of its largest usable size, then its remainder; only lone rows run single."""
    policy = case.policy
    buckets: dict[tuple[int, bool], list[int]] = {}
    for i, row in enumerate(case.batch.rows):
        if _batchable(row, policy):
            buckets.setdefault((policy.padded_length(row.length), row.sampling is None), []).append(i)
    planned: dict[tuple[int, bool], list[int]] = {}
    for request in _plan(case):
        if request.kind is RequestKind.REGULAR_BATCHED:
            row = case.batch.rows[request.source_rows[0]]
            planned.setdefault((request.padded_length, row.sampling is None), []).append(request.active_batch_size)
    for key, members in buckets.items():
        assert sorted(planned.get(key, [])) == _expected_wave_sizes(len(members), policy, key[0])


@given(cases())
def test_exact_partial_waves_carry_no_padding_rows(case):
    """Without pad_partial_waves, a wave pads only when its rows are fewer than the smallest wave."""
    policy = attrs.evolve(case.policy, pad_partial_waves=False)
    for request in plan_prefill(case.batch, policy, case.layout):
        if request.padded_batch != request.active_batch_size:
            assert request.active_batch_size < min(policy.waves)


# ---------------------------------------------------------------- 4-6. tables


@given(cases())
def test_regular_tables_hold_each_rows_real_blocks_then_skip(case):
    """A regular table row is the row's ceil(length/bs) mapped blocks then -1; padding rows are all -1."""
    bs = case.layout.block_size
    for request in _plan(case):
        if request.kind.is_chunked:
            continue
        assert request.read_table is None and request.num_chunks == 1
        chunk = request.chunk(0)
        assert (chunk.start, chunk.length, chunk.is_final) == (0, request.padded_length, True)
        assert chunk.fill_table.role is TableRole.REGULAR
        table = request.fill_table_of(chunk)
        assert len(table) == request.padded_batch
        width = len(table[0])
        assert width * bs >= request.padded_length
        for physical, entries in enumerate(table):
            if physical < request.active_batch_size:
                row = case.batch.rows[request.source_rows[physical]]
                real = -(-row.length // bs)
                assert entries == row.blocks[:real] + (SKIP,) * (width - real)
            else:
                assert entries == (SKIP,) * width


@given(cases())
def test_write_tables_never_carry_stale_tails_or_padding(case):
    """REGULAR and FILL_ONLY tables hold only -1 or blocks inside the row's written range."""
    bs = case.layout.block_size
    for request in _plan(case):
        for chunk in request.chunks:
            assert chunk.fill_table.role in (TableRole.REGULAR, TableRole.FILL_ONLY)
            for physical, entries in enumerate(request.fill_table_of(chunk)):
                if physical >= request.active_batch_size:
                    assert set(entries) == {SKIP}
                    continue
                row = case.batch.rows[request.source_rows[physical]]
                written = written_columns(row.length, row.cached, bs)
                allowed = set(row.blocks[written.start : written.stop]) | {SKIP}
                assert set(entries) <= allowed
                # Once an entry is -1, the rest of the row is too (no holes, no tail).
                first_skip = entries.index(SKIP) if SKIP in entries else len(entries)
                assert set(entries[first_skip:]) <= {SKIP}


@given(cases())
def test_chunked_full_table_is_all_non_negative(case):
    """A chunked request's read table has no -1: mapped blocks, then a valid filler reaching past the last chunk."""
    bs, pool = case.layout.block_size, case.layout.num_blocks
    for request in _plan(case):
        if not request.kind.is_chunked:
            continue
        assert request.read_table.role is TableRole.CHUNKED_FULL
        (entries,) = request.read_table_values()
        row = case.batch.rows[request.source_rows[0]]
        real = -(-row.length // bs)
        assert entries[:real] == row.blocks[:real]
        assert all(0 <= block < pool for block in entries)
        assert len(entries) * bs >= request.final_chunk.end


@given(cases())
def test_fill_only_tables_hold_exactly_the_blocks_each_chunk_writes(case):
    """Column j of a chunk's fill table is block first_block+j when the chunk writes it, else -1."""
    bs = case.layout.block_size
    for request in _plan(case):
        if not request.kind.is_chunked:
            continue
        row = case.batch.rows[request.source_rows[0]]
        for chunk in request.chunks:
            assert chunk.fill_table.role is TableRole.FILL_ONLY
            (entries,) = request.fill_table_of(chunk)
            written = written_columns(row.length, row.cached, bs)
            lo = max(written.start, chunk.start // bs)
            hi = min(written.stop, chunk.end // bs)
            for column, block in enumerate(entries):
                index = chunk.first_block + column
                assert block == (row.blocks[index] if lo <= index < hi else SKIP)


# ---------------------------------------------------------------- 7-9. chunks and writes


@given(cases())
def test_written_blocks_are_exactly_cached_to_length(case):
    """Every row writes each block of its written columns (cached // bs to its last) exactly once, nothing else."""
    written = writes_by_source_row(_plan(case))
    expected = expected_writes(case.batch, case.layout.block_size)
    assert {row: sorted(w) for row, w in written.items()} == expected


@given(cases())
def test_chunks_are_ordered_contiguous_and_only_the_last_is_final(case):
    """Chunks tile [first start, end) back to back from the block holding the cached offset; only the last is final."""
    bs = case.layout.block_size
    for request in _plan(case):
        chunks = request.chunks
        assert len(chunks) == request.num_chunks >= 1
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert [c.is_final for c in chunks] == [False] * (len(chunks) - 1) + [True]
        for before, after in zip(chunks, chunks[1:]):
            assert after.start == before.end
        for chunk in chunks:
            assert chunk.start % bs == 0 and chunk.first_block == chunk.start // bs
            assert chunk.length == request.chunk_length > 0
        if request.kind.is_chunked:
            length, cached = request.lengths[0], request.cached[0]
            assert chunks[0].start == computed_start(length, cached, bs)
            assert chunks[0].start <= min(cached, length - 1) < chunks[0].start + bs
            assert request.recomputed_tokens == cached - chunks[0].start
            assert request.chunk_length % bs == 0 and request.chunk_length <= case.policy.max_chunk_length
        assert {case.policy.padded_length(n) for n in request.lengths} == {request.padded_length}


@given(cases())
def test_chunked_requests_are_exactly_the_long_or_cached_rows(case):
    """A row runs chunked exactly when it has a cached prefix or its rung exceeds the max chunk length."""
    for request in _plan(case):
        for index in request.source_rows:
            row = case.batch.rows[index]
            long_or_cached = row.cached > 0 or case.policy.padded_length(row.length) > case.policy.max_chunk_length
            assert request.kind.is_chunked == long_or_cached


@given(cases())
def test_last_token_lies_in_the_final_chunk(case):
    """Every row's last-token position is length-1, inside the final chunk; no chunk runs after it."""
    for request in _plan(case):
        assert request.last_token_positions == tuple(n - 1 for n in request.lengths)
        final = request.final_chunk
        for last in request.last_token_positions:
            assert final.start <= last < final.end
        assert all(chunk.end <= max(request.last_token_positions) for chunk in request.chunks[:-1])


@given(cases())
def test_no_block_is_written_twice_or_over_a_cached_block(case):
    """Across a batch, each block is written at most once and (no row writing another's) never one read as cached."""
    bs = case.layout.block_size
    blocks = [block for writes in writes_by_source_row(_plan(case)).values() for _, block in writes]
    assert len(blocks) == len(set(blocks))
    cached = {b for row in case.batch.rows for b in row.blocks[: _first_written(row, bs)]}
    assert cached.isdisjoint(blocks)


# ---------------------------------------------------------------- 10. purity


@given(cases())
def test_planning_is_deterministic(case):
    """Planning the same input twice gives equal requests and equal prepared values."""
    assert _plan(case) == _plan(case)
    assert prepare_prefill(case.batch, case.policy, case.layout) == prepare_prefill(
        case.batch, case.policy, case.layout
    )


@given(cases())
def test_planning_leaves_its_inputs_unchanged(case):
    """The batch, policy and layout serialize identically before and after preparing them."""
    before = [to_json(case.batch), to_json(case.policy), to_json(case.layout)]
    prepare_prefill(case.batch, case.policy, case.layout)
    assert [to_json(case.batch), to_json(case.policy), to_json(case.layout)] == before


# ---------------------------------------------------------------- 11. planning fallback


@given(cases())
def test_fallback_to_singles_keeps_every_rows_writes_and_last_token(case):
    """Disabling batching (or every wave above 1) changes geometry only: each row writes the same blocks."""
    baseline = _plan(case)
    written = writes_by_source_row(baseline)
    placed = source_of(baseline)
    for policy in (attrs.evolve(case.policy, batching_enabled=False), attrs.evolve(case.policy, waves=(1,))):
        fallback = plan_prefill(case.batch, policy, case.layout)
        assert all(r.kind is not RequestKind.REGULAR_BATCHED for r in fallback)
        assert writes_by_source_row(fallback) == written
        for row, (request, _physical) in source_of(fallback).items():
            before, at = placed[row]
            assert request.last_token_positions[0] == before.last_token_positions[at]
            if before.kind.is_chunked:
                assert request.chunks == before.chunks


# ---------------------------------------------------------------- 13. fully cached rows


@given(fully_cached_cases())
def test_fully_cached_row_reruns_its_final_block_read_only(case_and_row):
    """A fully cached row runs one step of min(rung(bs), max chunk) from its last block's start, writing nothing."""
    case, index = case_and_row
    bs = case.layout.block_size
    row = case.batch.rows[index]
    request, _ = source_of(_plan(case))[index]
    assert request.kind is RequestKind.CHUNKED
    (chunk,) = request.chunks
    assert chunk.length == min(case.policy.padded_length(bs), case.policy.max_chunk_length)
    assert chunk.is_final and chunk.start == (row.length - 1) // bs * bs
    assert chunk.start <= request.last_token_positions[0] == row.length - 1 < chunk.end
    (fill,) = request.fill_table_of(chunk)
    assert set(fill) == {SKIP}
    (read,) = request.read_table_values()
    real = -(-row.length // bs)
    assert read[:real] == row.blocks[:real]


# ---------------------------------------------------------------- 14. serialization


@given(cases())
def test_values_round_trip_through_json(case):
    """Batches, policies, layouts, requests and prepared values survive to_json/from_json unchanged."""
    prepared = prepare_prefill(case.batch, case.policy, case.layout)
    requests = tuple(p.request for p in prepared)
    for value, kind in (
        (case.batch, PrefillBatch),
        (case.policy, PrefillPolicy),
        (case.layout, PageTableLayout),
        (requests, tuple[PrefillRequest, ...]),
        (prepared, tuple[PreparedPrefill, ...]),
    ):
        assert from_json(kind, to_json(value)) == value
