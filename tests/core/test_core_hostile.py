"""Odd but legal values and malformed CLI input: each plans correctly or fails with a named error."""

from __future__ import annotations

import pytest

from prefill_core import PageTableLayout, PrefillBatch, PrefillPolicy, PrefillRow, manifest_for, prepare_prefill


@pytest.mark.parametrize(
    ("policy", "block_size", "length"),
    [
        (PrefillPolicy.fine_rungs(32), 32, 2048),  # the last bucket of a fine ladder, at full capacity
        (PrefillPolicy(length_ladder=(64,)), 64, 100),  # a bucket one block wide
        (PrefillPolicy(tile_size=64, length_ladder=()), 64, 74),
    ],
)
def test_manifest_covers_a_row_cached_inside_its_first_block(policy, block_size, length):
    """A row cached inside its first block recomputes its whole length: its chunk body is in the manifest."""
    width = -(-length // block_size)
    layout = PageTableLayout(block_size, width, width)
    for cached in (1, block_size // 2, min(block_size - 1, length - 1)):
        batch = PrefillBatch.from_rows([PrefillRow(length, cached, 0, tuple(range(width)))])
        (prepared,) = prepare_prefill(batch, policy, layout)
        assert prepared.request.first_chunk_start == 0
        assert manifest_for(policy, layout).covers(prepared)
