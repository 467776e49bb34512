"""A hybrid step's per-group tables on ttnn: staged exactly as the contract declares them.

The padded hybrid step's ``contract.GROUPED_INPUTS`` (each KV group's fill and read tables, first readable
columns and reused spans, as ``prefill_core.GroupedRequest.step_tables`` plans them) stage as int32
ROW_MAJOR host tensors of the contract's shape, every value kept (``-1`` fills, the filler 0), so a TTTv2
model slices group g's ``[B, W]`` table off the leading dimension; a value int32 cannot hold is a named error.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillBatch, prepare_grouped
from prefill_core.values.errors import PrefillInputError
from prefill_shell.device.contract import GROUP_FILL_TABLES, GROUP_READ_TABLES, GROUPED_INPUTS
from prefill_shell.engine.steps.call_steps import GroupedSteps
from prefill_shell.engine.steps.inputs import build_host_steps
from prefill_shell.tt import staging as ttnn_staging
from tests import window_kit as kit


def _host_steps():
    """The host steps of a two-row Ministral-shaped call cached past a 24-token window (sliding blocks of 8)."""
    attention = kit.attention_of(("sliding_attention", "full_attention", "sliding_attention"), 24, 8)
    tables = kit.fresh_tables(attention, [150, 101])
    batch = PrefillBatch((150, 101), (70, 37), (0, 1), tables[0], (None, None))
    planned = prepare_grouped(batch, kit.POLICY, PageTableLayout(16, 32, 200), attention, tables, null_block=kit.NULL)
    tokens = torch.zeros(2, 150, dtype=torch.int64)
    return [step for g in planned for step in GroupedSteps(build_host_steps(tokens, g.request), g, 64)]


def test_every_per_group_input_stages_as_int32_row_major_of_its_host_shape(ttnn):
    """Each staged group input holds its host values exactly, -1 and the filler 0 included, in the contract's form."""
    steps = _host_steps()
    assert any(GROUP_READ_TABLES in step for step in steps) and any(
        (step[GROUP_FILL_TABLES] < 0).any() for step in steps
    )
    for step in steps:
        for spec in GROUPED_INPUTS:
            if spec not in step:
                continue
            staged = ttnn_staging.stage(spec, step[spec])
            assert (staged.dtype, staged.layout) == (ttnn.int32, ttnn.ROW_MAJOR_LAYOUT)
            assert tuple(staged.shape) == tuple(step[spec].shape)
            assert torch.equal(ttnn.to_torch(staged).to(torch.int64), step[spec].to(torch.int64))
            assert ttnn_staging.contract_of(spec).dtype == "int32"


def test_a_group_table_value_int32_cannot_hold_is_a_named_error(ttnn):
    """An id past int32 is refused naming the input and its index, not wrapped."""
    table = torch.tensor([[[1, 2, 1 << 33]]], dtype=torch.int64)
    with pytest.raises(PrefillInputError, match=r"group_fill_tables\[0, 0, 2\]"):
        ttnn_staging.stage(GROUP_FILL_TABLES, table)
