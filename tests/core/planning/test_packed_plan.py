"""Packed plans (planning/packed.py): real tokens only, each row's owed positions exactly once, own blocks only."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given

from prefill_core import (
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    RequestKind,
    SamplingParams,
    plan_packed,
    prepare_packed,
)
from prefill_core.values.computed_positions import written_columns
from prefill_core.values.errors import BlockDependencyCycleError
from prefill_core.values.intmath import ceil_div
from tests.strategies import cases, same_step_prefix_specs


def _plan(case):
    return plan_packed(case.batch, case.policy, case.layout)


@given(cases())
def test_segments_cover_exactly_cached_to_length_per_row(case):
    """Each row's segments, in step order, tile [cached, length) once (a fully cached row: its last token only)."""
    covered: dict[int, list[tuple[int, int]]] = {}
    for request in _plan(case):
        for step in request.steps:
            for segment in step.segments:
                covered.setdefault(segment.row, []).append((segment.start, segment.end))
    for row, (length, cached) in enumerate(zip(case.batch.lengths, case.batch.cached)):
        want_start = length - 1 if cached == length else cached
        spans = covered[row]
        assert spans[0][0] == want_start and spans[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"row {row}: gaps or overlaps {spans}"


@given(cases())
def test_steps_are_packed_end_to_end_within_the_budget(case):
    """Segments of a step sit end to end from offset 0; a step holds at most the max chunk, and only the last
    step of a stream is short."""
    for request in _plan(case):
        for step in request.steps:
            offsets = [s.offset for s in step.segments]
            assert offsets == [sum(s.length for s in step.segments[:i]) for i in range(len(step.segments))]
            assert 0 < step.tokens <= case.policy.max_chunk_length
        assert request.computed_tokens == request.real_tokens


@given(cases())
def test_every_position_computed_is_owed_so_positions_equal_real_tokens(case):
    """Positions computed over the whole plan equal the real tokens: max(length - cached, 1) per row."""
    owed = sum(max(n - c, 1) for n, c in zip(case.batch.lengths, case.batch.cached))
    assert sum(r.computed_tokens for r in _plan(case)) == owed


@given(cases())
def test_writes_stay_in_the_rows_own_uncached_blocks_and_no_other_rows(case):
    """A segment writes only its row's blocks [cached // bs, ceil(length / bs)), never one another row maps;
    a fully cached row writes nothing."""
    bs = case.layout.block_size
    mappers: dict[int, set[int]] = {}  # block -> rows that map it
    for row, (blocks, length) in enumerate(zip(case.batch.blocks, case.batch.lengths)):
        for block in blocks[: ceil_div(length, bs)]:
            mappers.setdefault(block, set()).add(row)
    for request in _plan(case):
        for index in range(request.num_chunks):
            for row, blocks in request.written_blocks(index).items():
                length, cached = case.batch.lengths[row], case.batch.cached[row]
                written = set(blocks)
                if cached == length:
                    assert not written
                    continue
                assert written <= set(case.batch.blocks[row][cached // bs : ceil_div(length, bs)])
                assert all(mappers[b] == {row} for b in written), f"row {row} writes a block another row maps"


@given(cases())
def test_every_row_ends_in_exactly_one_request_at_its_last_token(case):
    """Source rows partition the batch; each last-token offset points at the row's length - 1 in the final step."""
    ended = []
    for request in _plan(case):
        ended += request.source_rows
        final = {s.row: s for s in request.steps[-1].segments}
        for row, offset in zip(request.source_rows, request.last_token_offsets):
            segment = final[row]
            assert segment.end == case.batch.lengths[row]
            assert offset == segment.offset + segment.length - 1
        assert {s is None for s in request.sampling} in ({True}, {False})  # one postprocessing kind
    assert sorted(ended) == list(range(len(case.batch)))


def test_cached_and_uncached_rows_share_a_step_and_a_fully_cached_row_recomputes_one_token():
    """At block 32: rows (112, 32 cached), (144, 64 cached), (300 uncached) and (64 fully cached) form one step
    of 80 + 80 + 300 + 1 positions."""
    rows = [(112, 32), (144, 64), (300, 0), (64, 64)]
    blocks, first = [], 0
    for length, _ in rows:
        blocks.append(tuple(range(first, first + ceil_div(length, 32))))
        first += len(blocks[-1])
    batch = PrefillBatch.from_rows([PrefillRow(n, c, slot, b) for slot, ((n, c), b) in enumerate(zip(rows, blocks))])
    (request,) = plan_packed(batch, PrefillPolicy(), PageTableLayout(32, 16, first))
    (step,) = request.steps
    assert [(s.row, s.start, s.length, s.writes) for s in step.segments] == [
        (0, 32, 80, True),
        (1, 64, 80, True),
        (2, 0, 300, True),
        (3, 63, 1, False),
    ]
    assert request.source_rows == (0, 1, 2, 3) and request.last_token_offsets == (79, 159, 459, 460)


def test_a_row_longer_than_the_budget_continues_in_the_next_step_and_ends_one_request():
    """With a 128-token budget a 300-token row spans three steps; the rows ending in its first step end a request."""
    policy = attrs.evolve(PrefillPolicy(), max_chunk_length=128)
    batch = PrefillBatch.from_rows(
        [PrefillRow(40, 0, 0, (0, 1)), PrefillRow(300, 0, 1, tuple(range(2, 12))), PrefillRow(10, 0, 2, (12,))]
    )
    first, second = plan_packed(batch, policy, PageTableLayout(32, 16, 13))
    assert first.source_rows == (0,) and len(first.steps) == 1
    assert second.source_rows == (1, 2) and [s.tokens for s in second.steps] == [128, 94]
    assert [(s.row, s.start, s.length) for s in second.steps[0].segments] == [(1, 88, 128)]


def test_logits_and_sampled_rows_pack_in_separate_steps_with_packed_identities():
    """Logits rows and sampled rows never share a step; each request's program is variant PACKED, untraced."""
    batch = PrefillBatch.from_rows(
        [
            PrefillRow(50, 0, 0, (0, 1)),
            PrefillRow(70, 0, 1, (2, 3, 4), SamplingParams.greedy()),
            PrefillRow(20, 0, 2, (5,)),
        ]
    )
    prepared = prepare_packed(batch, PrefillPolicy(), PageTableLayout(32, 16, 6))
    assert [p.request.source_rows for p in prepared] == [(0, 2), (1,)]
    assert all(p.program_signature.variant is RequestKind.PACKED and p.trace_signature is None for p in prepared)
    assert [p.program_signature.padded_batch for p in prepared] == [2, 1]


@given(same_step_prefix_specs())
def test_a_row_reading_blocks_another_row_writes_is_packed_after_the_writers_last_segment(spec):
    """Same-step prefix hits: every reader's first segment comes at or after its writer's last, in (step, offset)."""
    case = spec.build()
    bs = case.layout.block_size
    order, first, last = 0, {}, {}
    for request in plan_packed(case.batch, case.policy, case.layout):
        for step in request.steps:
            order += 1
            for segment in step.segments:
                first.setdefault(segment.row, (order, segment.offset))
                last[segment.row] = (order, segment.offset)
    writer = {}
    for row, r in enumerate(case.batch.rows):
        columns = written_columns(r.length, r.cached, bs)
        writer.update({r.blocks[j]: row for j in columns})
    for row, r in enumerate(case.batch.rows):
        columns = written_columns(r.length, r.cached, bs)
        read = r.blocks[: columns.start if columns else ceil_div(r.length, bs)]
        for block in set(read) & writer.keys():
            assert last[writer[block]] < first[row], (row, block, writer[block])


def test_a_logits_row_reading_a_sampled_rows_blocks_packs_the_sampled_rows_first():
    """Row 0 (logits) reads block 5 that row 1 (sampled) writes whole: row 1's step runs first."""
    batch = PrefillBatch.from_rows([PrefillRow(40, 32, 0, (5, 6)), PrefillRow(32, 0, 1, (5,), SamplingParams.greedy())])
    requests = plan_packed(batch, PrefillPolicy(), PageTableLayout(32, 4, 7))
    assert [r.source_rows for r in requests] == [(1,), (0,)]


def test_readers_across_both_kinds_each_way_are_a_named_cycle_error():
    """A logits row reading a sampled row's block and a sampled row reading a logits row's: no kind order serves."""
    batch = PrefillBatch.from_rows(
        [
            PrefillRow(40, 32, 0, (5, 6)),
            PrefillRow(32, 0, 1, (5,), SamplingParams.greedy()),
            PrefillRow(40, 32, 2, (7, 8), SamplingParams.greedy()),
            PrefillRow(32, 0, 3, (7,)),
        ]
    )
    with pytest.raises(BlockDependencyCycleError, match="row 2: blocks is invalid"):
        plan_packed(batch, PrefillPolicy(), PageTableLayout(32, 4, 9))
