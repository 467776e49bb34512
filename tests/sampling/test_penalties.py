"""vLLM's penalties (repetition over prompt and output, frequency and presence over output) vs a float64 reference."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import PrefillPolicy, SamplingParams
from prefill_core.values.errors import InvalidSamplingError
from prefill_shell.backends import TorchBackend
from prefill_shell.sampling.penalties import apply_penalties, sample_penalised
from prefill_shell.serving.facade import ServingFacade
from tests.penalty_reference import reference_penalties

BLOCK = 16
VOCAB = 256


@given(
    st.lists(st.floats(-30, 30, width=32), min_size=12, max_size=12),
    st.lists(st.integers(0, 11), max_size=10),
    st.lists(st.integers(0, 11), max_size=10),
    st.floats(0.05, 3.0),
    st.floats(-2, 2),
    st.floats(-2, 2),
)
def test_penalties_match_the_float64_reference(logits, prompt, output, repetition, presence, frequency):
    """Every token's penalised logit equals the float64 reference within float32 rounding."""
    got = apply_penalties(
        torch.tensor(logits),
        torch.tensor(prompt, dtype=torch.int64),
        torch.tensor(output, dtype=torch.int64),
        repetition=repetition,
        presence=presence,
        frequency=frequency,
    )
    want = reference_penalties(logits, set(prompt), output, repetition, presence, frequency)
    for g, w in zip(got.tolist(), want):
        assert math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-5)


def test_repetition_13_moves_the_argmax_off_a_prompt_token_only_when_it_should():
    """2.0 in the prompt falls to 2.0/1.3 < 1.8 (argmax moves); 3.0 falls to 2.31 > 1.8 (it stays); -1 grows."""
    logits = torch.tensor([2.0, 1.8, -1.0, 0.0])
    moved = apply_penalties(
        logits, torch.tensor([0, 2]), torch.tensor([], dtype=torch.int64), repetition=1.3, presence=0.0, frequency=0.0
    )
    assert int(moved.argmax()) == 1 and moved[2].item() == pytest.approx(-1.3)
    kept = apply_penalties(
        torch.tensor([3.0, 1.8, -1.0, 0.0]),
        torch.tensor([0]),
        torch.tensor([], dtype=torch.int64),
        repetition=1.3,
        presence=0.0,
        frequency=0.0,
    )
    assert int(kept.argmax()) == 0


@pytest.fixture(scope="module")
def facade(tiny_model):
    policy = PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,))
    facade = ServingFacade(tiny_model, TorchBackend(), max_seq_len=256, max_batch_size=8, policy=policy)
    spec = tiny_model.spec
    facade.allocate_kv_cache((64, spec.num_kv_heads, BLOCK, spec.head_dim), tiny_model.dtype, spec.num_layers)
    return facade


def _sampling(rows: int, **fields):
    base = dict(
        temperature=[0.0] * rows,
        top_k=[1] * rows,
        top_p=[0.0] * rows,
        seed=[-1] * rows,
        num_logprobs=[0] * rows,
        repetition_penalty=[1.0] * rows,
    )
    return SimpleNamespace(**(base | fields))


def test_a_greedy_row_with_repetition_13_takes_the_penalised_argmax(facade, kit):
    """Through prefill_forward: the token is the penalised argmax (it moves on some rows), its log-prob raw."""
    rows = 6
    tokens = kit.token_matrix([kit.make_tokens(120, seed=40 + r) for r in range(rows)])
    table = kit.page_table(kit.assign_blocks([120] * rows, BLOCK, 64, seed=4))
    call = dict(prompt_lens=[120] * rows, start_pos=[0] * rows, kv_cache=facade.kv)
    logits = facade.prefill_forward(tokens, table, enable_trace=False, **call)[:, 0]
    got, log_probs = facade.prefill_forward(
        tokens, table, enable_trace=False, sampling_params=_sampling(rows, repetition_penalty=[1.3] * rows), **call
    )
    moved = 0
    for row in range(rows):
        prompt = set(tokens[row].tolist())
        penalised = torch.tensor(reference_penalties(logits[row].double(), prompt, [], 1.3, 0.0, 0.0))
        assert got[row].item() == int(penalised.argmax())
        moved += int(penalised.argmax()) != int(logits[row].argmax())
        raw = torch.log_softmax(logits[row].double(), -1)[got[row]].item()
        assert abs(log_probs[row].item() - raw) <= 1e-5
    assert moved >= 1  # the check bites: on at least one row the penalty changes the argmax


def test_output_tokens_feed_frequency_and_presence(facade, kit):
    """output_tokens (padded with -1) count for frequency and presence; without them only the prompt matters."""
    tokens = kit.token_matrix([kit.make_tokens(60, seed=50)])
    table = kit.page_table(kit.assign_blocks([60], BLOCK, 64, seed=5))
    call = dict(prompt_lens=[60], start_pos=[0], kv_cache=facade.kv)
    logits = facade.prefill_forward(tokens, table, enable_trace=False, **call)[0, 0]
    top = int(logits.argmax())
    sampling = _sampling(1, presence_penalty=[2.0], frequency_penalty=[2.0])
    alone, _ = facade.prefill_forward(tokens, table, enable_trace=False, sampling_params=sampling, **call)
    assert alone.item() == top  # no output tokens: presence and frequency change nothing
    output = torch.tensor([[top, top, -1]])
    pushed, _ = facade.prefill_forward(
        tokens, table, enable_trace=False, sampling_params=sampling, output_tokens=output, **call
    )
    want = torch.tensor(reference_penalties(logits.double(), set(), [top, top], 1.0, 2.0, 2.0)).argmax()
    assert pushed.item() == int(want) != top


@pytest.mark.parametrize(
    "repetition, logits, prompt, want",
    [
        # r -> 0+: seen positive logits l / r pass +inf; the largest of them (token 2's 3.0) takes all the mass.
        (5e-324, [4.0, 1.0, 3.0, 0.5, 0.0], [1, 2, 3], 2),
        (1e-45, [0.0, 1.0, 3.0, 0.5, 2.0], [1, 2, 3], 2),
        # r -> inf, every token seen, every logit <= 0: l * r -> -inf (0 stays 0: no 0 * inf NaN).
        (1e39, [-4.0, -1.0, -3.0, -0.5, -2.0], [0, 1, 2, 3, 4], 3),
        (1e39, [-4.0, 0.0, -3.0, -0.5, -2.0], [0, 1, 2, 3, 4], 1),
    ],
)
def test_a_penalty_past_the_float_range_gives_its_limit_never_nan(repetition, logits, prompt, want):
    """A repetition penalty that sends logits to +-inf samples the limit's token (greedy and sampled), not token 0."""
    penalised = apply_penalties(
        torch.tensor(logits),
        torch.tensor(prompt, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        repetition=repetition,
        presence=0.0,
        frequency=0.0,
    )
    assert not torch.isnan(penalised).any()
    assert int(torch.argmax(penalised)) == want
    params = SimpleNamespace(repetition=repetition, presence=0.0, frequency=0.0)
    for sampling in (SamplingParams.greedy(), SamplingParams(temperature=1.0, top_k=0, top_p=1.0)):
        for seed in range(5):
            token, _ = sample_penalised(
                torch.tensor(logits), torch.tensor(prompt), torch.zeros(0, dtype=torch.int64), params, sampling, seed
            )
            assert token == want


@pytest.mark.parametrize("field", ["prompt_ids", "output_ids"])
@pytest.mark.parametrize("bad", [-1, 16], ids=["negative", "vocab"])
def test_ids_outside_the_vocabulary_are_named_not_indexed_or_ignored(field, bad):
    """apply_penalties takes ids in [0, V): another is an InvalidSamplingError (was IndexError / silently ignored)."""
    ids = {"prompt_ids": torch.tensor([1, 2]), "output_ids": torch.tensor([3])}
    ids[field] = torch.tensor([1, bad])
    with pytest.raises(InvalidSamplingError, match=f"{field} holds id {bad}"):
        apply_penalties(
            torch.zeros(16), ids["prompt_ids"], ids["output_ids"], repetition=1.3, presence=0.5, frequency=0.5
        )
