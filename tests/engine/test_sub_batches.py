"""Calls with more rows than one lane's slots: split into sub-batches, results in caller order.

A lane holds ``policy.lane_size`` KV slots. Without explicit slots any number
of rows is valid (the runtime plans consecutive sub-batches of ``lane_size`` rows with slots
``0..k-1`` and maps their rows back); with explicit slots the core's slot
rule names the lane size.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import SamplingParams
from prefill_core.values.errors import BlockConflictError, InvalidCachedLengthError, InvalidSlotError
from tests.helpers import (
    CHUNK_256_POLICY,
    TOL,
    assign_blocks,
    build_runtime,
    make_tokens,
    max_abs_diff,
    page_table,
    token_matrix,
)

BS = 16
SUB_BATCH_POLICY = attrs.evolve(CHUNK_256_POLICY, lane_size=4)
"""Four slots per lane, so ten rows make three sub-batches (4, 4, 2)."""


def _rows(lengths, seed):
    return [make_tokens(n, seed=seed + i) for i, n in enumerate(lengths)]


def _alone(rt, tokens, blocks, length, cached=0, sampling=None):
    """One row prefilled on its own: the reference for that row."""
    return rt.prefill(tokens[None], page_table([blocks]), [length], [cached], sampling=[sampling])[0]


def test_issue_reproducer_33_rows_without_slots_prefill_in_caller_order(tiny_model):
    """33 rows without explicit slots (the default 32-slot lane) prefill, each row matching its own single run."""
    rt = build_runtime(tiny_model, num_blocks=40, block_size=BS)
    tokens = torch.randint(1, 256, (33, 16), generator=torch.Generator().manual_seed(3))
    table = torch.arange(33, dtype=torch.int32)[:, None]
    results = rt.prefill(tokens, table, [16] * 33)
    assert [r.row for r in results] == list(range(33))
    for row in (0, 31, 32):
        expected = _alone(rt, tokens[row], [row], 16)
        assert max_abs_diff(results[row].logits, expected.logits) <= TOL, f"row {row}"
    assert rt.backend.ledger.live() == []


def test_mixed_rows_across_sub_batches_match_each_row_alone(tiny_model):
    """Ten rows (waves, a chunked row, cached rows, every sampling path) in three sub-batches match each row alone."""
    rt = build_runtime(tiny_model, num_blocks=96, block_size=BS, policy=SUB_BATCH_POLICY)
    lengths = [40, 300, 70, 33, 90, 64, 100, 20, 48, 130]
    cached = [0, 0, 0, 0, 32, 0, 64, 0, 48, 0]
    sampling = [
        None,
        SamplingParams.greedy(num_logprobs=2),
        None,
        SamplingParams(top_k=5, seed=1),
        None,
        SamplingParams(top_k=0, seed=4, num_logprobs=1),
        None,
        None,
        SamplingParams.greedy(),
        None,
    ]
    rows = _rows(lengths, seed=700)
    blocks = assign_blocks(lengths, BS, 96, seed=7)
    reference = [_alone(rt, rows[i], blocks[i], n, 0, sampling[i]) for i, n in enumerate(lengths)]
    results = rt.prefill(token_matrix(rows), page_table(blocks), lengths, cached, sampling=sampling)
    assert len(rt.prepare(token_matrix(rows), page_table(blocks), lengths, cached).requests) >= 3
    for row, (got, want) in enumerate(zip(results, reference)):
        assert got.row == row and got.token == want.token, f"row {row}"
        if want.logits is not None:
            assert max_abs_diff(got.logits, want.logits) <= TOL, f"row {row}"
        else:  # a sampled row: its log-prob and its num_logprobs best, as the row alone gave them
            assert abs(got.logprob - want.logprob) <= TOL, f"row {row}"
            assert len(got.top_logprobs) == len(want.top_logprobs) == sampling[row].num_logprobs, f"row {row}"
            assert [i for i, _ in got.top_logprobs] == [i for i, _ in want.top_logprobs], f"row {row}"
            assert all(abs(a - b) <= TOL for (_, a), (_, b) in zip(got.top_logprobs, want.top_logprobs)), f"row {row}"
    assert rt.backend.ledger.live() == []


def test_streaming_across_sub_batches_yields_caller_rows_one_invocation_at_a_time(tiny_model):
    """invocations() stays lazy across sub-batches and stream() names caller rows, covering every row once."""
    rt = build_runtime(tiny_model, num_blocks=64, block_size=BS, policy=SUB_BATCH_POLICY)
    lengths = [20] * 10
    rows = _rows(lengths, seed=800)
    batch = rt.prepare(token_matrix(rows), page_table(assign_blocks(lengths, BS, 64, seed=8)), lengths)
    stream = rt.invocations(batch)
    first = next(stream)
    assert rt.backend.ledger.live() == [h for h in first.owned]  # only the first invocation ran
    seen = [r.row for r in rt.stream([first, *stream])]
    assert sorted(seen) == list(range(10))
    assert rt.backend.ledger.live() == []


def test_a_block_written_by_rows_in_two_sub_batches_is_a_conflict_naming_the_caller_row(tiny_model):
    """Rows 0 and 5 sit in different sub-batches; writing one block from both is refused naming caller row 5."""
    rt = build_runtime(tiny_model, num_blocks=64, block_size=BS, policy=SUB_BATCH_POLICY)
    lengths = [20] * 6
    blocks = assign_blocks(lengths, BS, 64, seed=9)
    blocks[5][0] = blocks[0][0]
    with pytest.raises(BlockConflictError, match="row 5"):
        rt.prepare(token_matrix(_rows(lengths, seed=900)), page_table(blocks), lengths)
    assert rt.backend.ledger.allocations == 0


def test_an_input_error_in_a_later_sub_batch_names_the_caller_row(tiny_model):
    """A bad cached length at caller row 6 (second sub-batch, its row 2) is reported as row 6."""
    rt = build_runtime(tiny_model, num_blocks=64, block_size=BS, policy=SUB_BATCH_POLICY)
    lengths = [40] * 8
    cached = [0] * 8
    cached[6] = 41  # past its 40-token prompt
    blocks = assign_blocks(lengths, BS, 64, seed=10)
    with pytest.raises(InvalidCachedLengthError, match="row 6"):
        rt.prepare(token_matrix(_rows(lengths, seed=1000)), page_table(blocks), lengths, cached)


def test_explicit_slots_beyond_the_lane_name_the_lane_size(tiny_model):
    """33 rows with explicit slots 0..32 raise the slot error naming row 32 and lane_size=32."""
    rt = build_runtime(tiny_model, num_blocks=40, block_size=BS)
    tokens = torch.randint(1, 256, (33, 16), generator=torch.Generator().manual_seed(4))
    with pytest.raises(InvalidSlotError, match=r"row 32.*lane_size=32"):
        rt.prepare(tokens, torch.arange(33, dtype=torch.int32)[:, None], [16] * 33, slots=list(range(33)))
    assert rt.backend.ledger.allocations == 0
