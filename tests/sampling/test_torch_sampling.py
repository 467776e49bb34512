"""``torch_sampling``'s support (top-k, top-p, both, on tied logits) against vLLM's rule.

The oracle is ``tests/sampling/topk_topp_reference.py`` (plain Python floats, written
from vLLM's code); ``tests/vllm/test_vllm_sampler.py`` compares the same
support with vLLM's own function where vLLM is installed.
"""

from __future__ import annotations

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prefill_shell.sampling.torch_sampling import sample_row, support_logits
from tests.sampling.topk_topp_reference import vllm_support


def _support(logits: torch.Tensor, top_k: int, top_p: float, temperature: float) -> set[int]:
    kept = support_logits(logits, top_k, top_p, temperature)
    return {int(i) for i in torch.nonzero(kept > float("-inf")).flatten()}


@st.composite
def tied_rows(draw):
    """Rows of few distinct values (ties everywhere), and parameters that cut through the ties."""
    vocab = draw(st.integers(2, 24))
    levels = draw(st.lists(st.floats(-8.0, 8.0, width=16), min_size=1, max_size=4))
    logits = [draw(st.sampled_from(levels)) for _ in range(vocab)]
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    row = torch.tensor(logits, dtype=torch.float32).to(dtype)
    # top_k 1 is greedy here (``prefill_core.is_greedy``: the argmax, lowest id among tied maxima), never
    # this support: see test_top_k_one_is_greedy_even_on_tied_maxima.
    top_k = draw(st.integers(0, vocab + 1).filter(lambda k: k != 1))
    top_p = draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True)))
    temperature = draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))  # powers of two: dividing rounds nothing
    return row, top_k, top_p, temperature


@given(tied_rows())
def test_support_equals_vllms_rule_on_tied_logits(case):
    row, top_k, top_p, temperature = case
    expected, ambiguous = vllm_support(row.double().tolist(), top_k, top_p, temperature)
    assume(not ambiguous)
    assert _support(row, top_k, top_p, temperature) == expected


def test_top_k_keeps_every_token_tied_with_the_kth():
    # The 2nd largest logit is shared by ids 1, 2 and 4: vLLM masks only logits below it, so all stay.
    row = torch.tensor([3.0, 2.0, 2.0, 1.0, 2.0, 0.0])
    assert _support(row, 2, 1.0, 1.0) == {0, 1, 2, 4}
    assert _support(row.bfloat16(), 2, 1.0, 1.0) == {0, 1, 2, 4}
    # ... and the draw reaches each of them.
    drawn = {int(sample_row(row, 2, 1.0, 1.0, seed)) for seed in range(200)}
    assert drawn == {0, 1, 2, 4}


def test_top_p_drops_the_lower_id_of_a_tie_at_its_boundary_as_vllm_does():
    # Three equal logits, p = 0.5: vLLM's ascending cumulative mass is 1/3, 2/3, 1 over ids 0, 1, 2,
    # so id 0 (mass 1/3 <= 0.5) is masked and ids 1 and 2 stay.
    row = torch.zeros(3)
    assert _support(row, 0, 0.5, 1.0) == {1, 2}
    assert vllm_support([0.0, 0.0, 0.0], 0, 0.5, 1.0) == ({1, 2}, False)


def test_top_k_then_top_p_renormalises_over_the_tied_survivors():
    # top-k 2 keeps ids 0, 1, 2 (1 and 2 tie at the 2nd); top-p 0.9 over those three drops nothing
    # that vLLM keeps: the survivors' masses are e/(e+2), 1/(e+2), 1/(e+2).
    row = torch.tensor([1.0, 0.0, 0.0, -1.0])
    expected, ambiguous = vllm_support(row.tolist(), 2, 0.9, 1.0)
    assert not ambiguous and expected == {0, 1, 2}
    assert _support(row, 2, 0.9, 1.0) == expected


def test_top_k_one_is_greedy_even_on_tied_maxima():
    # A deliberate difference from vLLM, which samples among tied maxima at temperature > 0 with top_k 1:
    # here top_k 1 is greedy (the device argmax path takes such rows), so the lowest tied id, every seed.
    row = torch.tensor([1.0, 3.0, 3.0, 0.0])
    assert {int(sample_row(row, 1, 1.0, 1.0, seed)) for seed in range(50)} == {1}
