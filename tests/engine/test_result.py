"""``PrefillResult``: an immutable value that compares logits by value."""

from __future__ import annotations

import pytest
import torch

from prefill_shell.engine.result import PrefillResult


def test_results_with_equal_logits_in_other_tensors_are_equal_and_hash_alike():
    """Two results whose logits hold the same values (NaN included) are ==, with equal hashes."""
    logits = torch.tensor([0.5, float("nan"), -1.0])
    a, b = PrefillResult(3, logits=logits), PrefillResult(3, logits=logits.clone())
    assert a == b and not a != b and hash(a) == hash(b)


@pytest.mark.parametrize(
    "other",
    [
        PrefillResult(3, logits=torch.tensor([0.5, 0.0, -1.0])),
        PrefillResult(4, logits=torch.tensor([0.5, float("nan"), -1.0])),
        PrefillResult(3, logits=torch.tensor([0.5, float("nan"), -1.0], dtype=torch.float64)),
        PrefillResult(3, token=1, logprob=-0.1),
    ],
)
def test_a_different_value_row_or_dtype_is_unequal(other):
    """A result differs when its logits, row, dtype or sampled fields differ."""
    assert PrefillResult(3, logits=torch.tensor([0.5, float("nan"), -1.0])) != other


def test_sampled_results_compare_by_token_logprob_and_top_logprobs():
    """Sampled results are equal exactly when token, log-prob and top log-probs are."""
    a = PrefillResult(0, token=7, logprob=-0.5, top_logprobs=((7, -0.5), (2, -1.5)))
    assert a == PrefillResult(0, token=7, logprob=-0.5, top_logprobs=((7, -0.5), (2, -1.5)))
    assert a != PrefillResult(0, token=7, logprob=-0.5, top_logprobs=((7, -0.5),))


def test_a_result_cannot_be_changed():
    """Assigning a field raises: the caller gets a value, not a record the runtime could alter."""
    result = PrefillResult(0, token=1)
    with pytest.raises(AttributeError):
        result.token = 2
