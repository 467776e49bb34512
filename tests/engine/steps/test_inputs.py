"""Staged page tables cut from the caller's tensor equal the core's pure materializer."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import PageTableLayout, PrefillBatch, PrefillPolicy, PrefillRow, plan_prefill
from prefill_shell.device.contract import FILL_TABLE, READ_TABLE
from prefill_shell.engine.steps.inputs import build_host_steps

LAYOUT = PageTableLayout(16, 64, 512)
POLICY = PrefillPolicy(length_ladder=(32, 64, 128), max_chunk_length=128, chunk_quantum=64, waves=(1, 2, 4, 8))


@st.composite
def planned_calls(draw):
    rows = draw(st.integers(1, 10))
    lengths = draw(st.lists(st.integers(1, 400), min_size=rows, max_size=rows))
    need = [-(-n // 16) for n in lengths]
    cached = [draw(st.integers(0, n // 16)) * 16 for n in lengths]
    order = draw(st.permutations(range(512)))
    table = torch.full((rows, max(need) + 3), 5, dtype=torch.int32)  # stale tails: block 5
    first, batch_rows = 0, []
    for row, n in enumerate(need):
        table[row, :n] = torch.tensor(order[first : first + n])
        first += n
        batch_rows.append(PrefillRow(lengths[row], cached[row], row, tuple(table[row, :n].tolist())))
    return table, plan_prefill(PrefillBatch.from_rows(tuple(batch_rows)), POLICY, LAYOUT)


@given(call=planned_calls())
def test_tables_cut_from_the_caller_tensor_equal_the_materializer(call):
    """For every chunk of every planned request, the staged fill and read tables are the core's integers."""
    table, requests = call
    tokens = torch.ones(table.shape[0], 400, dtype=torch.int64)
    for request in requests:
        steps = build_host_steps(tokens, request, table)
        assert len(steps) == request.num_chunks
        assert [step.index for step in steps[1:]] == [step.index for step in steps][1:] == list(range(1, len(steps)))
        for index, (step, chunk) in enumerate(zip(steps, request.chunks)):
            assert step.index == chunk.index == index
            assert step[FILL_TABLE].tolist() == [list(row) for row in request.fill_table_of(chunk)]
            assert (READ_TABLE in step) == request.kind.is_chunked
            if READ_TABLE in step:
                assert step[READ_TABLE].tolist() == [list(row) for row in request.read_table_values()]


@given(call=planned_calls())
def test_without_the_caller_table_the_steps_hold_the_same_values(call):
    """Steps built from the request's own block ids equal the ones cut from the caller's table, value for value."""
    table, requests = call
    tokens = torch.arange(table.shape[0] * 400, dtype=torch.int64).view(table.shape[0], 400)
    for request in requests:
        for cut, own in zip(build_host_steps(tokens, request, table), build_host_steps(tokens, request), strict=True):
            assert cut.keys() == own.keys()
            assert all(torch.equal(cut[spec], own[spec]) for spec in cut)
