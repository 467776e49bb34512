"""``PrefillResult``: an immutable value that compares logits by value."""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import SamplingParams
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.result import PrefillResult
from tests.helpers import TOL, build_runtime, make_tokens, max_abs_diff, page_table, token_matrix


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


class _OverflowingHead:
    """Delegates to a model; every ``lm_head`` call writes ``value`` into its rows at ``slots`` (a float16
    overflow gives +inf there; a broken kernel NaN)."""

    def __init__(self, inner, value: float, slots=(1,)):
        self.inner, self.spec, self.dtype, self.value, self.slots = inner, inner.spec, inner.dtype, value, slots
        self.new_kv_cache = inner.new_kv_cache

    def forward_hidden(self, *args):
        return self.inner.forward_hidden(*args)

    def lm_head(self, rows):
        out = self.inner.lm_head(rows).clone()
        for slot in self.slots:
            if slot < out.shape[0]:
                out[slot, : out.shape[-1] // 2] = self.value
        return out


SAMPLINGS = {
    "logits": None,
    "argmax": SamplingParams.greedy(num_logprobs=2),
    "device top-k": SamplingParams(temperature=0.8, top_k=5, seed=3, num_logprobs=1),
    "host": SamplingParams(temperature=0.8, top_k=0, seed=3),
}


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["+inf", "nan"])
@pytest.mark.parametrize("path", list(SAMPLINGS))
def test_a_row_with_nonfinite_logits_says_so_and_the_others_are_unaffected(tiny_model, path, value):
    """One row's logits hold +inf or NaN (the head's wave slot 1). Before, it came back as a token (often 0)
    with a NaN log-prob and no sign; now ``nonfinite`` is True on it alone (per row and in the batch-shaped
    result), the other rows as on a clean model."""
    lengths = [40, 30, 20]
    rows = [make_tokens(n, seed=10 + i) for i, n in enumerate(lengths)]
    args = (token_matrix(rows), page_table([[1, 2], [3, 4], [5]]), lengths)
    sampling = SAMPLINGS[path]
    clean = build_runtime(tiny_model, num_blocks=16, block_size=32).prefill(*args, sampling=sampling)
    runtime = build_runtime(_OverflowingHead(tiny_model, value), num_blocks=16, block_size=32)
    got = runtime.prefill(*args, sampling=sampling)
    flags = [r.nonfinite for r in got]
    assert sum(flags) == 1 and not any(r.nonfinite for r in clean)  # the one row the head overflowed
    for g, c, flag in zip(got, clean, flags):
        if not flag:  # as on the clean model (the wrapper's protocol-only path may round differently: TOL)
            assert g.token == c.token and [i for i, _ in g.top_logprobs] == [i for i, _ in c.top_logprobs]
            assert (g.logits is None and abs(g.logprob - c.logprob) <= TOL) or max_abs_diff(g.logits, c.logits) <= TOL
    no_lists = None if sampling is None else attrs.evolve(sampling, num_logprobs=0)  # a batch holds none
    batch = PrefillExecutor(runtime).prefill(*args, sampling=no_lists, batched=True)
    assert batch.nonfinite.tolist() == flags
