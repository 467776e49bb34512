"""``prepare_in_sub_batches``: a batch with more rows than ``lane_size`` plans in sub-batches, in caller rows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import PageTableLayout, PrefillBatch, PrefillPolicy, PrefillRow, prepare_in_sub_batches
from prefill_core.values.errors import BlockConflictError

POLICY = PrefillPolicy(lane_size=4, waves=(1, 2, 4), length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64)
LAYOUT = PageTableLayout(16, 8, 256)


def _batch(lengths: list[int]) -> PrefillBatch:
    rows, first = [], 0
    for row, length in enumerate(lengths):
        need = -(-length // 16)
        rows.append(PrefillRow(length, 0, row, tuple(range(first, first + need))))
        first += need
    return PrefillBatch.from_rows(tuple(rows))


@given(st.lists(st.integers(1, 100), min_size=1, max_size=13))
def test_every_caller_row_lands_once_with_a_slot_inside_the_lane(lengths):
    """Each caller row appears in exactly one request, and every slot lies in [0, lane_size)."""
    prepared = prepare_in_sub_batches(_batch(lengths), POLICY, LAYOUT)
    rows = sorted(r for p in prepared for r in p.request.source_rows)
    assert rows == list(range(len(lengths)))
    assert all(0 <= slot < POLICY.lane_size for p in prepared for slot in p.request.slots)
    for p in prepared:
        assert [lengths[r] for r in p.request.source_rows] == list(p.request.lengths)


def test_a_block_written_by_rows_of_two_sub_batches_is_named_in_caller_rows():
    """Rules hold across sub-batches: row 5 (second sub-batch) writing row 0's block is refused naming row 5."""
    rows = [PrefillRow(16, 0, r, (r,)) for r in range(6)]
    rows[5] = PrefillRow(16, 0, 5, (0,))
    with pytest.raises(BlockConflictError, match="row 5"):
        prepare_in_sub_batches(PrefillBatch.from_rows(tuple(rows)), POLICY, LAYOUT)
