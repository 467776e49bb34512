"""The columnar ``PrefillBatch``: column passes decide, the row-by-row path names.

Validation runs as C-level passes over whole columns and, only when one
fails, walks the rows to name the first broken rule. These tests pin that
the two agree: the error named is always the one a row-by-row walk finds
first, whichever column noticed.
"""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import (
    InvalidPageTableError,
    PageTableLayout,
    PrefillBatch,
    PrefillInputError,
    PrefillPolicy,
    PrefillRow,
    SamplingParams,
    plan_prefill,
    prepare_prefill,
)
from prefill_core.errors import BlockConflictError, InvalidLengthError, InvalidSlotError
from tests.strategies import cases

LAYOUT = PageTableLayout(block_size=32, max_num_blocks_per_seq=4096, num_blocks=10_000)
POLICY = PrefillPolicy()


@given(cases())
def test_rows_round_trip_through_columns(case):
    """``from_rows`` then ``rows`` gives back the same rows, and ``row(i)`` each one."""
    rows = case.batch.rows
    again = PrefillBatch.from_rows(list(rows))
    assert again == case.batch and again.rows == rows
    assert all(again.row(i) == row for i, row in enumerate(rows))
    assert len(again) == len(rows)


def test_columns_of_unequal_length_are_named():
    with pytest.raises(PrefillInputError) as caught:
        PrefillBatch((10, 20), (0, 0), (0,), ((0,), (1,)), (None, None))
    assert caught.value.field == "slots" and "one entry per row (2 rows)" in str(caught.value)


def test_a_column_that_is_not_a_tuple_is_named():
    with pytest.raises(PrefillInputError) as caught:
        PrefillBatch([10], (0,), (0,), ((0,),), (None,))
    assert caught.value.field == "lengths"


def test_the_earliest_row_is_named_when_several_break_rules():
    """Row 1's bad length is named before row 2's duplicate slot and row 3's bad length."""
    batch_rows = [
        PrefillRow(10, 0, 0, (0,)),
        PrefillRow(0, 0, 1, (1,)),
        PrefillRow(10, 0, 0, (2,)),
        PrefillRow(-3, 0, 3, (3,)),
    ]
    with pytest.raises(InvalidLengthError) as caught:
        PrefillBatch.from_rows(batch_rows)
    assert caught.value.row == 1
    batch_rows[1] = PrefillRow(10, 0, 1, (1,))
    with pytest.raises(InvalidSlotError) as caught:
        PrefillBatch.from_rows(batch_rows)
    assert caught.value.row == 2


def _long_row(blocks) -> PrefillBatch:
    return PrefillBatch.from_rows([PrefillRow(len(blocks) * 32, 0, 0, tuple(blocks))])


@pytest.mark.parametrize("order", ["ascending", "shuffled"])
@pytest.mark.parametrize("bad", [-1, 10_000])
@pytest.mark.parametrize("where", [1, 500, 1023])
def test_an_out_of_pool_id_in_a_long_table_is_named(order, bad, where):
    """Both the ascending-table path (one sort) and the general path find a bad id anywhere."""
    blocks = list(range(100, 1124))
    if order == "shuffled":
        random.Random(where).shuffle(blocks)
    blocks[where] = bad
    with pytest.raises(InvalidPageTableError) as caught:
        plan_prefill(_long_row(blocks), POLICY, LAYOUT)
    assert caught.value.field == f"blocks[{where}]" and repr(bad) in str(caught.value)


def test_a_long_table_that_only_looks_ascending_still_gets_exact_bounds():
    """Sampled entries ascend but an unsorted middle holds an out-of-pool id."""
    blocks = list(range(0, 1024))
    blocks[300], blocks[301] = 10_001, 5
    with pytest.raises(InvalidPageTableError) as caught:
        plan_prefill(_long_row(blocks), POLICY, LAYOUT)
    assert caught.value.field == "blocks[300]"


def test_a_repeated_block_in_an_ascending_long_table_is_a_conflict():
    blocks = list(range(0, 1024))
    blocks[700] = blocks[699]
    with pytest.raises(BlockConflictError) as caught:
        plan_prefill(_long_row(blocks), POLICY, LAYOUT)
    assert caught.value.field == "blocks[700]"


@given(st.data())
def test_shared_sampling_objects_are_checked_for_every_row(data):
    """One bad SamplingParams object shared by later rows is named at its first row."""
    n = data.draw(st.integers(2, 8))
    first_bad = data.draw(st.integers(0, n - 1))
    bad = attrs.evolve(SamplingParams(), top_p=0.0)
    params = [SamplingParams.greedy()] * first_bad + [bad] * (n - first_bad)
    batch = PrefillBatch.from_rows([PrefillRow(64, 0, i, (2 * i, 2 * i + 1), params[i]) for i in range(n)])
    with pytest.raises(PrefillInputError) as caught:
        prepare_prefill(batch, POLICY, LAYOUT)
    assert caught.value.row == first_bad and caught.value.field == "sampling.top_p"
