"""prefill_shell.pooling.plugin_model: the plugin pooling runner's call, ``forward(input_ids, attention_mask)``, padded
as vllm-tt-plugin's ``TTPoolingModelRunner._prepare_model_inputs`` pads (right, float 0/1 mask), returns one row per
request equal to the runtime's pooling of the unpadded prompt, computing real tokens only."""

from __future__ import annotations

import pytest
import torch

from prefill_core.values.pooling import (
    ClassifyActivation,
    InvalidPoolingError,
    PoolerConfig,
    PoolingParams,
    PoolingType,
)
from prefill_shell.pooling import PoolingRunner
from prefill_shell.pooling.plugin_model import RuntimePoolingModel
from prefill_shell.reference import random_llama


def _padded(prompts: list[list[int]], left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The plugin's batch: tokens right-padded with 0 to the longest, a float32 0/1 mask (or left-padded)."""
    longest = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.int64)
    mask = torch.zeros(len(prompts), longest, dtype=torch.float32)
    for i, prompt in enumerate(prompts):
        span = slice(longest - len(prompt), longest) if left else slice(0, len(prompt))
        tokens[i, span] = torch.tensor(prompt)
        mask[i, span] = 1.0
    return tokens, mask


@pytest.mark.parametrize("left", [False, True])
def test_forward_pools_the_real_tokens_only(left):
    model = random_llama(5, "tiny")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (3, 100, 40)]
    runner = PoolingRunner(model, PoolerConfig(hidden_size=64, pooling_type=PoolingType.MEAN), block_size=16)
    plugin_model = RuntimePoolingModel(runner)
    out = plugin_model.forward(*_padded(prompts, left))
    assert out.shape == (3, 64) and runner.computed_tokens == 143  # no pad position computed
    torch.testing.assert_close(out, torch.stack(runner.run(prompts)))
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(3))  # the folder default: normalised


def test_a_cross_encoder_returns_one_raw_logit_per_request():
    model = random_llama(6, "tiny")
    head = torch.randn(1, 64)
    pooler = PoolerConfig(hidden_size=64, num_labels=1, activation=ClassifyActivation.SIGMOID)
    runner = PoolingRunner(model, pooler, score=head, block_size=16)
    prompts = [[5, 6, 7], list(range(1, 90))]
    out = RuntimePoolingModel(runner)(*_padded(prompts))
    assert out.shape == (2, 1)
    torch.testing.assert_close(out, torch.stack(runner.run(prompts, PoolingParams.classify(use_activation=False))))


def test_a_row_the_mask_empties_is_named():
    runner = PoolingRunner(random_llama(5, "tiny"), PoolerConfig(hidden_size=64), block_size=16)
    tokens, mask = _padded([[1, 2], [3]])
    mask[1] = 0
    with pytest.raises(InvalidPoolingError, match="row 1: attention_mask keeps no token"):
        RuntimePoolingModel(runner).forward(tokens, mask)


def test_rows_that_begin_alike_compute_their_shared_positions_once():
    """LAST-pooled rows that begin alike (a query before each document, duplicates) share those positions:
    ``computed_tokens`` counts what the plans computed, and the vectors equal one-row-at-a-time runs'."""
    model = random_llama(5, "tiny")
    gen = torch.Generator().manual_seed(1)
    query = torch.randint(1, 256, (21,), generator=gen).tolist()
    prompts = [query + torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 9)] + [query, query]
    pooler = PoolerConfig(hidden_size=64, pooling_type=PoolingType.LAST)
    runner = PoolingRunner(model, pooler, block_size=16)
    together = runner.run(prompts)
    # 16 query tokens in a shared block (the runner's prefix call), 5 more computed once, then each row's own
    # tokens: 5 and 9 past the query, and the duplicates' last tokens.
    assert runner.computed_tokens == 16 + 5 + 5 + 9 + 1 + 1
    alone = PoolingRunner(model, pooler, block_size=16)
    for prompt, vector in zip(prompts, together):
        torch.testing.assert_close(vector, alone.run([prompt])[0], rtol=1e-5, atol=1e-5)
