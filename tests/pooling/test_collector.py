"""prefill_shell.pooling.collector and the heads (``engine.pooled_heads``): a row pooled across chunks, packed steps
and a shared prefix equals the same row pooled from one unchunked forward of the same model (the transformers and
sentence-transformers comparisons are in test_oracles.py)."""

from __future__ import annotations

import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_core.values.pooling import (
    ClassifyActivation,
    InvalidPoolingError,
    PoolerConfig,
    PoolingParams,
    PoolingPrefixError,
    PoolingType,
)
from prefill_shell.engine.pooled_heads import activate, embed_vectors
from prefill_shell.engine.steps.pooled_states import RowPool
from prefill_shell.pooling import PoolingRunner
from prefill_shell.reference import random_llama


@pytest.fixture(scope="module")
def model():
    return random_llama(3, "tiny")


def _one_pass(model, prompt: list[int]) -> torch.Tensor:
    """Every position's final hidden state from one regular (unchunked) forward: ``[len, hidden]`` float32."""
    n = len(prompt)
    padded = -(-n // 16) * 16
    tokens = torch.zeros(1, padded, dtype=torch.long)
    tokens[0, :n] = torch.tensor(prompt)
    kv = model.new_kv_cache(padded // 16, 16)
    table = torch.arange(padded // 16, dtype=torch.int32)[None]
    return model.forward_hidden(tokens, torch.zeros(1, dtype=torch.int32), table, None, kv)[0, :n].float()


def _prompts():
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (1, 5, 64, 65, 200, 333)]
    rows.append(rows[4][:96] + [7, 8, 9])  # shares six blocks with row 4
    rows.append(rows[4][:96] + [11] * 70)  # and again, past one more chunk
    return rows


@pytest.mark.parametrize("pooling_type", list(PoolingType))
@pytest.mark.parametrize("share", [True, False])
def test_a_row_pools_across_chunks_and_shared_prefixes_as_in_one_pass(model, pooling_type, share):
    runner = PoolingRunner(
        model,
        PoolerConfig(hidden_size=64, pooling_type=pooling_type, normalize=False),
        block_size=16,
        max_chunk=64,
        pool_tokens=4096,
    )
    prompts = _prompts()
    for prompt, vector in zip(prompts, runner.run(prompts, share_prefixes=share)):
        hidden = _one_pass(model, prompt)
        expected = {PoolingType.LAST: hidden[-1], PoolingType.MEAN: hidden.mean(0), PoolingType.CLS: hidden[0]}
        torch.testing.assert_close(vector, expected[pooling_type], rtol=1e-5, atol=1e-5)
    assert runner.runtime.backend.ledger.live() == []


TRACED_POLICY = PrefillPolicy(max_chunk_length=64, chunk_quantum=64, length_ladder=(64,), waves=(1, 2), lane_size=4)


@pytest.mark.parametrize("pooling_type", [PoolingType.LAST, PoolingType.MEAN])
def test_traced_replays_pool_as_eager_steps_do(model, pooling_type):
    """After a warm-up, a traced call replays padded waves; rows past one chunk and a shared prefix pool as in one
    pass (the hook copies what it keeps before the next replay overwrites the workspace)."""
    pooler = PoolerConfig(hidden_size=64, pooling_type=pooling_type, normalize=False)
    runner = PoolingRunner(model, pooler, block_size=16, pool_tokens=1024, policy=TRACED_POLICY, max_length=256)
    runner.warm_up()
    prompts = [p for p in _prompts() if len(p) <= 256]
    traced = runner.run(prompts, mode="traced")
    assert sum(trace.replays for trace in runner.runtime.captured_traces()) > 0
    for prompt, vector in zip(prompts, traced):
        hidden = _one_pass(model, prompt)
        expected = hidden[-1] if pooling_type is PoolingType.LAST else hidden.mean(0)
        torch.testing.assert_close(vector, expected, rtol=1e-5, atol=1e-5)


def test_rounds_split_rows_that_do_not_fit_the_pool_together(model):
    runner = PoolingRunner(model, PoolerConfig(hidden_size=64, normalize=False), block_size=16, pool_tokens=256)
    prompts = _prompts()[:6]  # 1 + 5 + 64 + 65 + 200 + 333 tokens > 256: several rounds; 333 alone does not fit
    with pytest.raises(Exception, match="row 5: 333 tokens need 21 blocks; the pool holds 16"):
        runner.run(prompts)
    out = runner.run(prompts[:5])
    for prompt, vector in zip(prompts, out):
        torch.testing.assert_close(vector, _one_pass(model, prompt)[-1], rtol=1e-5, atol=1e-5)


def test_heads_truncate_then_normalize_and_activate_per_row():
    pooled = torch.randn(3, 8)
    config = PoolerConfig(hidden_size=8, normalize=True, matryoshka=True)
    from prefill_core.values.pooling import resolve_rows

    rows = resolve_rows(
        [PoolingParams.embed(dimensions=4), PoolingParams.embed(normalize=False), PoolingParams.embed()], 3, config
    )
    a, b, c = embed_vectors(pooled, rows)
    torch.testing.assert_close(a, pooled[0, :4] / pooled[0, :4].norm())  # truncate, then normalise
    torch.testing.assert_close(b, pooled[1])
    torch.testing.assert_close(c, pooled[2] / pooled[2].norm())
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    torch.testing.assert_close(activate(logits, ClassifyActivation.SOFTMAX), logits.softmax(-1))
    torch.testing.assert_close(activate(logits, ClassifyActivation.SIGMOID), logits.sigmoid())


def test_a_mean_pool_is_one_sum_over_its_pieces():
    pool = RowPool(PoolingType.MEAN)
    pieces = torch.randn(10, 4).split([3, 1, 6])
    for piece in pieces:
        pool.add(piece)
    torch.testing.assert_close(pool.result(), torch.cat(pieces).mean(0))


def test_the_runner_names_bad_requests_before_running(model):
    runner = PoolingRunner(model, PoolerConfig(hidden_size=64), block_size=16)
    with pytest.raises(InvalidPoolingError, match="row 1: task='classify'.*no classification head"):
        runner.run([[1, 2], [3]], [PoolingParams(), PoolingParams.classify()])
    with pytest.raises(InvalidPoolingError, match="row 0: dimensions=8.*Matryoshka"):
        runner.run([[1, 2]], PoolingParams.embed(dimensions=8))
    assert issubclass(PoolingPrefixError, InvalidPoolingError)


def test_one_call_mixes_embed_and_classify_rows(model):
    """Rows choose their task like sampling: an embed row's vector and a classify row's probabilities in one call."""
    head = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    pooler = PoolerConfig(hidden_size=64, normalize=False, num_labels=3, activation=ClassifyActivation.SOFTMAX)
    runner = PoolingRunner(model, pooler, score=head, block_size=16, max_chunk=64)
    prompts = _prompts()[3:6]
    params = [PoolingParams.embed(), PoolingParams.classify(), PoolingParams.classify(use_activation=False)]
    embedded, probs, logits = runner.run(prompts, params)
    last = [_one_pass(model, p)[-1] for p in prompts]
    torch.testing.assert_close(embedded, last[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs, (head @ last[1]).softmax(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, head @ last[2], rtol=1e-5, atol=1e-5)
