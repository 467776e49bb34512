"""The torch path's sampling support against vLLM 0.33's own top-k / top-p masking, on tied logits.

vLLM's CPU sampler masks with ``apply_top_k_only`` (top-k alone) and
``apply_top_k_top_p_pytorch`` (top-p, or both) from
``vllm/v1/sample/ops/topk_topp_sampler.py``; both are called here on rows of
few distinct values, beside ``torch_sampling.support_logits``. Runs under
``make test-vllm``.

Top-k's support is a set fixed by the logits (ties with the k-th stay) and is
compared as a set. Top-p's is fixed up to which of several equal logits keep
their place where a tie straddles the boundary: vLLM sorts with
``torch.sort``, which on CPU orders equal values by ascending id up to 16
values and in no documented order beyond, so there the comparison is of the
kept logit values (as a sorted list: the same count of each value, which is
the same distribution over logits) and, up to 16 values, of the set.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` builds the venv that has it")

import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only, apply_top_k_top_p_pytorch

from prefill_shell.sampling.torch_sampling import support_logits

# float32 cumulative masses this close to 1 - p are left out: rounding decides them, not the rule.
AMBIGUOUS = 1e-5


def _vllm_kept(row: torch.Tensor, top_k: int, top_p: float) -> tuple[set[int], bool]:
    logits = row.float()[None].clone()
    vocab = logits.shape[-1]
    k = torch.tensor([top_k if 0 < top_k < vocab else vocab])
    if top_p < 1.0:
        masked = apply_top_k_top_p_pytorch(logits.clone(), k, torch.tensor([top_p]))
        # The cumulative masses vLLM compares with 1 - p, to leave rounding-decided rows out.
        kth_masked = apply_top_k_top_p_pytorch(logits.clone(), k, None)
        cumulative = torch.cumsum(kth_masked.sort(dim=-1).values.softmax(dim=-1), dim=-1)
        ambiguous = bool(((cumulative - (1 - top_p)).abs() < AMBIGUOUS).any())
    else:
        masked, ambiguous = apply_top_k_only(logits.clone(), k.clone()), False
    return _kept(masked[0]), ambiguous


def _kept(masked: torch.Tensor) -> set[int]:
    return {int(i) for i in torch.nonzero(masked > float("-inf")).flatten()}


@st.composite
def tied_rows(draw):
    vocab = draw(st.integers(2, 40))
    levels = draw(st.lists(st.floats(-8.0, 8.0, width=16), min_size=1, max_size=4))
    row = torch.tensor([draw(st.sampled_from(levels)) for _ in range(vocab)]).to(
        draw(st.sampled_from([torch.float32, torch.bfloat16]))
    )
    top_k = draw(st.integers(2, vocab + 1) | st.just(0))  # top_k 1 is greedy in the project (prefill_core.is_greedy)
    top_p = draw(st.just(1.0) | st.floats(0.0, 1.0, exclude_min=True))
    return row, top_k, top_p


@given(tied_rows())
def test_support_equals_vllms_masking_on_tied_logits(case):
    row, top_k, top_p = case
    expected, ambiguous = _vllm_kept(row, top_k, top_p)
    assume(not ambiguous)
    kept = _kept(support_logits(row, top_k, top_p, 1.0))
    values = row.float().tolist()
    assert sorted(values[i] for i in kept) == sorted(values[i] for i in expected)
    if top_p == 1.0 or len(values) <= 16:
        assert kept == expected
