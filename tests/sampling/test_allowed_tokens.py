"""Sampling at extreme parameters: the token always lies in the set float64 allows.

The allowed set is computed here in float64 from the very logits the sampler
saw, independently of ``prefill_shell.sampling.torch_sampling``: greedy rows allow
the argmax; other rows allow the top-k set (ties at the k-th value kept)
intersected with the top-p nucleus of the temperature-scaled probabilities.
A stand-in model whose LM head returns chosen logits drives the runtime's argmax,
device top-k (torch backend) and host paths with adversarial logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import PrefillPolicy, SamplingParams, SamplingPath
from prefill_shell.device.contract import TEMPERATURE, TOP_K, TOP_P, sampling_values
from prefill_shell.device.model import ModelSpec
from prefill_shell.reference import PagedKVCache
from prefill_shell.sampling.torch_sampling import sample_row, top_logprobs
from prefill_shell.tt import staging as tt_staging
from tests.helpers import build_runtime, page_table
from tests.strategies import adversarial_logits, extreme_sampling_params

VOCAB = 256
BS = 16
NUCLEUS_SLACK = 1e-9
"""Rounding slack on the nucleus boundary: a token is allowed if the mass strictly above it is < top_p + slack."""

ISSUE_PARAMS = [
    SamplingParams(temperature=1e-39, top_k=20, seed=1),
    SamplingParams(temperature=1e-300, top_k=20, seed=1),
    SamplingParams(temperature=1.0, top_k=20, top_p=1e-46, seed=1),
    SamplingParams(temperature=5e-324, top_k=0, seed=1),
    SamplingParams(temperature=1.0, top_k=0, top_p=1e-46, seed=1),
]
"""The issue's reproducers (device top-k and host top-k forms): each returned token 0, a non-top token."""


def allowed_tokens(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens ``params`` may return from ``logits [V]``, computed in float64."""
    x = logits.double()
    top = x.max()
    if params.is_greedy:
        return set((x == top).nonzero().flatten().tolist())
    scaled = (x - top) / params.temperature  # <= 0 everywhere; -inf stays -inf
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < params.top_k < len(x):
        kth = torch.sort(scaled, descending=True).values[params.top_k - 1]
        keep = scaled >= kth
    probs = torch.where(keep, scaled.exp(), torch.zeros_like(scaled))
    probs = probs / probs.sum()
    allowed = set()
    for token in (probs > 0).nonzero().flatten().tolist():
        mass_above = probs[probs > probs[token]].sum().item()
        if mass_above < params.top_p + NUCLEUS_SLACK:
            allowed.add(token)
    return allowed


def expected_logprob(logits: torch.Tensor, token: int) -> float:
    return torch.log_softmax(logits.double(), dim=-1)[token].item()


def assert_logprob_close(got: float, logits: torch.Tensor, token: int) -> None:
    want = expected_logprob(logits, token)
    assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-4), (got, want, token)


@pytest.fixture(scope="module")
def issue_logits():
    """Seeded logits whose argmax is not token 0, so a token-0 answer is visibly wrong."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(15))
    assert int(logits.argmax()) != 0
    return logits


class FixedLogitsModel:
    """A body that computes nothing and an LM head that returns ``self.logits`` for every row."""

    spec = ModelSpec(
        vocab_size=VOCAB, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, max_position=4096
    )
    dtype = torch.float32

    def __init__(self):
        self.logits = torch.zeros(VOCAB)

    def forward_hidden(self, tokens, start, fill_table, read_table, kv):
        return torch.zeros(tokens.shape[0], tokens.shape[1], self.spec.hidden_size)  # [B, S, H]

    def lm_head(self, rows):
        return self.logits.to(torch.float32).expand(rows.shape[0], -1).clone()  # [N, V]

    def new_kv_cache(self, num_blocks, block_size):
        spec = self.spec
        return PagedKVCache(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)


@pytest.fixture(scope="module")
def fixed():
    """A runtime over ``FixedLogitsModel`` and its model, so a test chooses the logits each call sees."""
    model = FixedLogitsModel()
    policy = PrefillPolicy(max_logprobs=5)
    return build_runtime(model, num_blocks=16, block_size=BS, policy=policy), model


def _run(fixed, logits: torch.Tensor, params: list[SamplingParams]):
    rt, model = fixed
    model.logits = logits
    rows = len(params)
    tokens = torch.randint(1, VOCAB, (rows, 8), generator=torch.Generator().manual_seed(rows))
    table = page_table([[row] for row in range(rows)])
    return rt.prefill(tokens, table, [8] * rows, sampling=params)


# ---------------------------------------------------------------- regressions (the issue's reproducers)


@pytest.mark.parametrize("params", ISSUE_PARAMS, ids=repr)
def test_torch_sampler_returns_an_allowed_token_at_tiny_temperature_or_top_p(issue_logits, params):
    """The torch sampler (the torch backend's and host sampling's per-row algorithm) never answers token 0 here."""
    token = sample_row(issue_logits, params.top_k, params.top_p, params.temperature, params.seed)
    assert int(token) in allowed_tokens(issue_logits, params)


@pytest.mark.parametrize("top_k", [20, 0], ids=["device top-k", "host"])
def test_runtime_with_underflowing_top_p_returns_the_top_token(fixed, issue_logits, top_k):
    """Through the runtime, top_p=1e-46 on the device and host paths returns the argmax with its log-prob."""
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=1e-46, seed=1)
    (result,) = _run(fixed, issue_logits, [params])
    assert result.token == int(issue_logits.argmax())
    assert_logprob_close(result.logprob, issue_logits, result.token)


def test_a_tiny_temperature_row_in_a_sampled_wave_returns_its_argmax(fixed, issue_logits):
    """A T=1e-39 row sharing a device top-k wave with a T=1 row is sampled as greedy, not as token 0."""
    params = [SamplingParams(temperature=1e-39, top_k=20, seed=1), SamplingParams(temperature=1.0, top_k=20, seed=2)]
    rt, _ = fixed
    assert (
        rt.prepare(torch.ones(2, 8, dtype=torch.int64), [[0], [1]], [8, 8], sampling=params).requests[0].sampling_path
        is SamplingPath.TOPK
    )
    first, second = _run(fixed, issue_logits, params)
    assert first.token == int(issue_logits.argmax())
    assert second.token in allowed_tokens(issue_logits, params[1])


# ---------------------------------------------------------------- properties


@given(logits=adversarial_logits(VOCAB), params=extreme_sampling_params())
def test_torch_sampler_token_lies_in_the_float64_allowed_set(logits, params):
    """For any accepted params and adversarial logits, the sampler's token is allowed and its log-prob exact."""
    x = torch.tensor(logits, dtype=torch.float32)
    token = sample_row(x, params.top_k, params.top_p, params.temperature, params.seed)
    assert int(token) in allowed_tokens(x, params)
    token_lp, _, _ = top_logprobs(x[None], token[None], params.num_logprobs)
    assert_logprob_close(float(token_lp[0]), x, int(token))


@given(logits=adversarial_logits(VOCAB), params=st.lists(extreme_sampling_params(), min_size=1, max_size=3))
def test_runtime_tokens_lie_in_the_float64_allowed_set_on_every_path(fixed, logits, params):
    """Through the runtime (argmax, device top-k and host paths), every row's token is allowed, log-prob exact."""
    x = torch.tensor(logits, dtype=torch.float32)
    for result, p in zip(_run(fixed, x, params), params):
        assert result.token in allowed_tokens(x, p), (p, result)
        assert_logprob_close(result.logprob, x, result.token)


# ---------------------------------------------------------------- ttnn staging


def _staged(monkeypatch, spec, values):
    """The host tensor the per-spec ``stage(spec, values)`` the runtime calls hands to ttnn."""
    monkeypatch.setattr(tt_staging, "_host", lambda value, dtype, layout, mesh_mapper: value)
    return tt_staging.stage(spec, values)


def test_staging_never_stages_an_inf_inverse_temperature_or_a_zero_top_p(monkeypatch):
    """Whatever P and T reach it (0, 1e-46, a T whose 1/T is 0), the bfloat16 forms are finite and positive."""
    p = torch.tensor([0.0, 1e-46, 1e-39, 0.5, 0.9], dtype=torch.float64)
    t = torch.tensor([float("inf"), 1e300, 2.0, 0.7], dtype=torch.float64)
    p_out, t_out = _staged(monkeypatch, TOP_P, p), _staged(monkeypatch, TEMPERATURE, t)
    p16, t16 = p_out.to(torch.bfloat16).float(), t_out.to(torch.bfloat16).float()
    assert torch.isfinite(t16).all() and (t16 >= torch.finfo(torch.bfloat16).tiny).all(), t16
    assert torch.isfinite(p16).all() and (p16 >= torch.finfo(torch.bfloat16).tiny).all(), p16
    assert torch.equal(p_out[3:], p[3:].float()) and torch.equal(t_out[2:], (1 / t[2:]).float())


def test_a_temperature_whose_inverse_overflows_bfloat16_stages_as_the_greedy_triple(monkeypatch):
    """A row that cold is greedy: its K, P, T reach staging as 1, 1, 1 (argmax at any draw), never an inf 1/T."""
    values = sampling_values((SamplingParams(temperature=1e-39, top_k=20, top_p=0.9), SamplingParams(top_k=20)))
    k_out, p_out, t_out = (_staged(monkeypatch, spec, values[spec]) for spec in (TOP_K, TOP_P, TEMPERATURE))
    assert (int(k_out[0]), float(p_out[0]), float(t_out[0])) == (1, 1.0, 1.0)
    assert int(k_out[1]) == 20


@given(params=st.lists(extreme_sampling_params(), min_size=1, max_size=4))
def test_staged_top_p_and_inverse_temperature_of_any_accepted_params_are_finite_and_positive(params):
    """For generated extreme params within the device cap, staged P and 1/T are finite and positive in bfloat16."""
    params = [
        p if p.is_greedy or 1 <= p.top_k <= tt_staging.MAX_DEVICE_TOP_K else SamplingParams.greedy() for p in params
    ]
    values = sampling_values(params)
    with pytest.MonkeyPatch.context() as monkeypatch:
        p_out, t_out = (_staged(monkeypatch, spec, values[spec]) for spec in (TOP_P, TEMPERATURE))
    for staged in (p_out, t_out):
        as16 = staged.to(torch.bfloat16).float()
        assert torch.isfinite(as16).all() and (as16 >= torch.finfo(torch.bfloat16).tiny).all(), (params, as16)
