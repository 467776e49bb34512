"""The reference model's LM head computes ``F.linear(rows, head)`` in float32, each row on its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefill_shell.reference import random_llama


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
    return random_llama(3, "tiny", tie_word_embeddings=request.param)


def _head_weight(model) -> torch.Tensor:
    tied = model.config.tie_word_embeddings
    return model.state_dict()["model.embed_tokens.weight" if tied else "lm_head.weight"]


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 40])
def test_lm_head_matches_linear(model, rows):
    hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    logits = model.lm_head(hidden)
    assert logits.shape == (rows, model.config.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(hidden, _head_weight(model)), rtol=1e-5, atol=1e-4)


def test_lm_head_keeps_each_row_apart(model):
    """Row i's logits depend on row i only."""
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    together = model.lm_head(hidden)
    for i in range(3):
        torch.testing.assert_close(together[i], model.lm_head(hidden[i : i + 1])[0], rtol=1e-5, atol=1e-4)
