"""Which positions a step computes (``computed_positions``) and the writer-before-reader order (``block_order``)."""

from __future__ import annotations

import pytest
from hypothesis import given

from prefill_core import (
    BlockConflictError,
    BlockDependencyCycleError,
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    plan_prefill,
    prepare_in_sub_batches,
)
from prefill_core.planning.block_order import order_writers_first
from prefill_core.values.computed_positions import computed_start, recomputed_positions, written_columns
from tests.core.plan_checks import expected_writes, source_of, writes_by_source_row
from tests.strategies import CaseSpec, cases, same_step_prefix_specs

LAYOUT = PageTableLayout(block_size=32, max_num_blocks_per_seq=64, num_blocks=100)


def _plan_rows(*rows: PrefillRow, policy: PrefillPolicy = PrefillPolicy()):
    return plan_prefill(PrefillBatch.from_rows(rows), policy, LAYOUT)


@pytest.mark.parametrize(
    ("length", "cached", "start", "recomputed", "written"),
    [
        (100, 0, 0, 0, range(0, 4)),
        (100, 40, 32, 8, range(1, 4)),  # inside block 1: recompute 32..39, rewrite block 1
        (100, 64, 64, 0, range(2, 4)),  # on a block boundary: nothing recomputed
        (100, 99, 96, 3, range(3, 4)),
        (100, 100, 96, 4, range(0)),  # fully cached: re-run the block of the last token, write nothing
        (96, 96, 64, 32, range(0)),
    ],
)
def test_the_rule_on_examples(length, cached, start, recomputed, written):
    """A start inside a block computes from that block's start, counts the recompute, and writes from that block."""
    assert computed_start(length, cached, 32) == start
    assert recomputed_positions(length, cached, 32) == recomputed
    assert written_columns(length, cached, 32) == written


@given(cases())
def test_every_chunk_starts_on_a_block_and_the_first_holds_the_cached_offset(case):
    """Any cached offset: chunk starts are block multiples; the first is the block start of min(cached, length - 1)."""
    bs = case.layout.block_size
    for request in plan_prefill(case.batch, case.policy, case.layout):
        assert all(chunk.start % bs == 0 for chunk in request.chunks)
        expected = 0
        for length, cached in zip(request.lengths, request.cached):
            first = request.chunk(0).start
            assert first <= min(cached, length - 1) < first + bs or not request.kind.is_chunked
            expected += recomputed_positions(length, cached, bs)
        assert request.recomputed_tokens == expected


def test_a_start_inside_a_block_rewrites_that_block_and_counts_it():
    """cached=40 (bs 32): one chunk from 32 writing blocks 1..3 of the row, 8 positions recomputed."""
    (request,) = _plan_rows(PrefillRow(100, 40, 0, (7, 8, 9, 10)))
    assert request.first_chunk_start == 32 and request.recomputed_tokens == 8
    assert request.fill_table_of(request.final_chunk)[0][:3] == (8, 9, 10)


def _read_and_written(spec_case):
    bs = spec_case.layout.block_size
    reads, writer = {}, {}
    for index, row in enumerate(spec_case.batch.rows):
        columns = written_columns(row.length, row.cached, bs)
        first = columns.start if columns else -(-row.length // bs)
        reads[index] = set(row.blocks[:first])
        writer.update({row.blocks[j]: index for j in columns})
    return reads, writer


@given(same_step_prefix_specs())
def test_reader_requests_run_after_the_requests_writing_their_blocks(spec: CaseSpec):
    """A row reading as cached a block another row of the call writes runs after it; writes are unchanged."""
    case = spec.build()
    requests = plan_prefill(case.batch, case.policy, case.layout)
    position = {row: at for at, request in enumerate(requests) for row in request.source_rows}
    reads, writer = _read_and_written(case)
    for row, blocks in reads.items():
        for block in blocks & writer.keys():
            assert position[writer[block]] < position[row], (row, block, writer[block])
    written = writes_by_source_row(requests)
    assert {row: sorted(w) for row, w in written.items()} == expected_writes(case.batch, case.layout.block_size)


@given(same_step_prefix_specs())
def test_lanes_keep_the_writer_first_order_across_sub_batches(spec: CaseSpec):
    """Split into one-row lanes, the call still runs every writer before its readers."""
    case = spec.build()
    policy = PrefillPolicy(lane_size=1)
    prepared = prepare_in_sub_batches(case.batch, policy, case.layout)
    position = {row: at for at, p in enumerate(prepared) for row in p.request.source_rows}
    reads, writer = _read_and_written(case)
    for row, blocks in reads.items():
        for block in blocks & writer.keys():
            assert position[writer[block]] < position[row]


def test_vllm_same_step_prefix_hit_runs_the_writer_first():
    """Row 0 reads blocks 5, 6 as cached; row 1 writes them in the same call: row 1 runs first."""
    rows = (PrefillRow(90, 64, 0, (5, 6, 9)), PrefillRow(100, 0, 1, (5, 6, 7, 8)))
    requests = _plan_rows(*rows)
    assert [r.source_rows for r in requests] == [(1,), (0,)]


def test_a_block_read_before_its_writer_fills_it_is_refused():
    """A reader mapping a block its writer covers only partly (length 80 < 96) is a BlockConflictError."""
    rows = (PrefillRow(90, 64, 0, (5, 6, 9)), PrefillRow(50, 0, 1, (5, 6)))
    with pytest.raises(BlockConflictError, match="row 0: blocks\\[1\\]=6 .*row 1 writes only its first 18 positions"):
        _plan_rows(*rows)


def test_a_block_written_at_another_column_than_it_is_read_is_refused():
    """The reader's column must be the writer's: other positions are other KV."""
    rows = (PrefillRow(90, 64, 0, (5, 6, 9)), PrefillRow(100, 0, 1, (4, 5, 6, 8)))
    with pytest.raises(BlockConflictError, match="row 1 writes it at column 1"):
        _plan_rows(*rows)


def test_a_dependency_cycle_is_a_named_error():
    """Requests that read each other's written blocks have no order: BlockDependencyCycleError names a row."""
    a = _plan_rows(PrefillRow(96, 32, 0, (1, 2, 3)))[0]  # reads 1, writes 2 and 3
    b = _plan_rows(PrefillRow(96, 32, 1, (2, 1, 4)))[0]  # reads 2, writes 1 and 4
    with pytest.raises(BlockDependencyCycleError, match="row 0: blocks is invalid") as caught:
        order_writers_first((a, b), 32)
    assert caught.value.row == 0 and caught.value.field == "blocks"


def test_a_call_without_shared_written_blocks_keeps_its_order():
    """No reader of a written block: the planned order is returned as it is."""
    rows = (PrefillRow(90, 64, 0, (5, 6, 9)), PrefillRow(100, 0, 1, (1, 2, 3, 4)))
    requests = _plan_rows(*rows)
    assert order_writers_first(requests, 32) is requests
    assert set(source_of(requests)) == {0, 1}
