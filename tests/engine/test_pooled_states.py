"""Pooled final hidden states as a call output (``PrefillCall.pooling``, ``PrefillResult.pooled``): every entry
that takes the call value returns each pooled row's LAST / MEAN / CLS vector, equal to one unchunked pass of the
same model, beside its usual last-token logits; bad requests are named before anything runs."""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout
from prefill_core.values.errors import PrefillInputError
from prefill_core.values.pooling import PoolingType
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference import random_llama
from tests.helpers import build_runtime
from tests.pooling.test_collector import _one_pass

BLOCK = 16
LENGTHS = [200, 5, 70, 33]


@pytest.fixture(scope="module")
def model():
    return random_llama(4, "tiny")


def _call(model):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 256, (len(LENGTHS), max(LENGTHS)), generator=gen)
    need = [-(-n // BLOCK) for n in LENGTHS]
    table = torch.full((len(LENGTHS), max(need)), -1, dtype=torch.int32)
    start = 0
    for row, n in enumerate(need):
        table[row, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    return tokens, table


@pytest.mark.parametrize("entry", ["runtime", "executor"])
def test_pooled_rows_equal_one_pass_and_the_logits_stay(model, entry):
    runtime = build_runtime(model, layout=PageTableLayout(BLOCK, 16, 64))
    target = runtime if entry == "runtime" else PrefillExecutor(runtime)
    tokens, table = _call(model)
    pooling = [PoolingType.MEAN, None, PoolingType.LAST, PoolingType.CLS]
    results = target.prefill(tokens, table, LENGTHS, pooling=pooling)
    plain = runtime.prefill(tokens, table, LENGTHS)
    for row, (result, kind) in enumerate(zip(results, pooling)):
        torch.testing.assert_close(result.logits, plain[row].logits)
        if kind is None:
            assert result.pooled is None
            continue
        hidden = _one_pass(model, tokens[row, : LENGTHS[row]].tolist())
        expected = {PoolingType.LAST: hidden[-1], PoolingType.MEAN: hidden.mean(0), PoolingType.CLS: hidden[0]}[kind]
        torch.testing.assert_close(result.pooled, expected, rtol=1e-5, atol=1e-5)
    assert runtime.backend.ledger.live() == []


def test_bad_pooling_requests_are_named_before_anything_runs(model):
    runtime = build_runtime(model, layout=PageTableLayout(BLOCK, 16, 64))
    tokens, table = _call(model)
    with pytest.raises(PrefillInputError, match="one PoolingType or None per row"):
        runtime.prefill(tokens, table, LENGTHS, pooling=[PoolingType.LAST])
    with pytest.raises(PrefillInputError, match="row 2: pooling='MEAN'"):
        runtime.prefill(tokens, table, LENGTHS, pooling=[None, None, "MEAN", None])
    with pytest.raises(PrefillInputError, match="batched=True"):
        runtime.prefill(tokens, table, LENGTHS, pooling=[PoolingType.LAST] * 4, batched=True)
    # A MEAN row whose cached prefix skips positions is refused by name (the pooling clients recompute it).
    with pytest.raises(PrefillInputError, match="row 0: position 0 is not computed"):
        runtime.prefill(tokens, table, LENGTHS, [32, 0, 0, 0], pooling=[PoolingType.MEAN, None, None, None])
    assert runtime.backend.ledger.live() == []


def test_a_lane_group_returns_each_lanes_pooled_rows_in_caller_order(model):
    """Rows routed to two lanes by slot: each lane pools its own rows (for_rows carries the pooling column)."""
    from tests.lane_kit import group_call, make_group

    rows = [(70, 0, None), (5, 0, None), (40, 0, None), (20, 0, None), (64, 0, None)]
    call = group_call(rows, slots=(5, 0, 6, 1, 4), num_lanes=2)
    pooling = [PoolingType.MEAN, PoolingType.LAST, None, PoolingType.CLS, PoolingType.LAST]
    results = make_group(model, 2).prefill(**call.kwargs(), pooling=pooling)
    for row, (result, kind) in enumerate(zip(results, pooling)):
        assert result.row == row
        if kind is None:
            assert result.pooled is None
            continue
        hidden = _one_pass(model, call.tokens[row, : rows[row][0]].tolist())
        expected = {PoolingType.LAST: hidden[-1], PoolingType.MEAN: hidden.mean(0), PoolingType.CLS: hidden[0]}[kind]
        torch.testing.assert_close(result.pooled, expected, rtol=1e-5, atol=1e-5)
