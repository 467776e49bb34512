"""``PrefillPolicy.fine_rungs``: the CPU backend's policy pads little and still fits every block size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import PageTableLayout, PrefillPolicy
from prefill_core.values.errors import InvalidPolicyError
from prefill_core.values.policy import check_policy_fits_layout


@given(block=st.sampled_from((8, 16, 32, 64, 128)), length=st.integers(1, 8192))
def test_fine_rungs_pad_less_than_a_block_up_to_the_max_chunk_and_a_quarter_chunk_beyond(block, length):
    """Up to the max chunk a prompt pads to its next block; up to four max chunks, to its next quarter chunk."""
    policy = PrefillPolicy.fine_rungs(block)
    rung = policy.padded_length(length)
    assert rung >= length and rung % block == 0
    assert rung - length < (block if length <= policy.max_chunk_length else policy.max_chunk_length // 4)
    check_policy_fits_layout(policy, PageTableLayout(block, 8192 // block, 8192 // block))


def test_fine_rungs_split_partial_waves_exactly():
    """No padding rows: a partial wave splits into supported sizes instead."""
    assert PrefillPolicy.fine_rungs(32).split_wave(7) == [4, 2, 1]


def test_a_block_that_cannot_quarter_the_max_chunk_is_named():
    """fine_rungs refuses a block size whose quarter-chunk rungs would not be block multiples."""
    with pytest.raises(InvalidPolicyError, match="block_size"):
        PrefillPolicy.fine_rungs(48)
