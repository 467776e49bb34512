"""Sampling paths end to end: argmax, seeded device top-k/top-p, host sampling, log-probs.

Supports and log-probs are computed here from the oracle's logits (HF Llama
on the same weights), never from the runtime's own helpers.
"""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from prefill_core import SamplingParams, SamplingPath
from tests.helpers import (
    CHUNK_256_POLICY,
    TOL,
    VOCAB,
    assign_blocks,
    build_runtime,
    make_tokens,
    max_abs_diff,
    page_table,
    token_matrix,
)

BS = 16
NUM_BLOCKS = 136
SUPPORT_EPS = 1e-3  # slack at the top-k / top-p boundary for the runtime-vs-oracle logit difference


def _support(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens with non-zero probability after temperature, top-k and top-p (boundary ties included)."""
    scaled = logits.double() / params.temperature
    order = torch.argsort(scaled, descending=True)
    if 0 < params.top_k < len(order):
        kth = scaled[order[params.top_k - 1]]
        order = order[scaled[order] >= kth - SUPPORT_EPS]
    probs = torch.softmax(scaled[order], dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    return set(order[mass_before < params.top_p + SUPPORT_EPS].tolist())


class _Scenario:
    """Prompts with per-row sampling params, run through one runtime on fixed disjoint blocks."""

    def __init__(self, rt, prompts: list[torch.Tensor], sampling: list[SamplingParams]):
        self.rt, self.sampling = rt, sampling
        self.lengths = [len(p) for p in prompts]
        self.table = page_table(assign_blocks(self.lengths, BS, NUM_BLOCKS, seed=len(prompts)))
        self.tokens = token_matrix(prompts)

    def prepare(self):
        return self.rt.prepare(self.tokens, self.table, self.lengths, sampling=self.sampling)

    def run(self):
        return self.rt.prefill(self.tokens, self.table, self.lengths, sampling=self.sampling)


def _runtime(tiny_model, policy=None, seed=0):
    policy = policy or CHUNK_256_POLICY
    return build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=policy, seed=seed)


@pytest.fixture(scope="module")
def prompts():
    """Three short prompts (padded to 128) that sampling rows draw from."""
    return [make_tokens(n, seed=900 + n) for n in (64, 50, 37)]


# ---------------------------------------------------------------- argmax


def test_all_greedy_rows_take_argmax_path_and_return_oracle_argmax(tiny_model, oracle):
    """A wave of greedy rows is classified ARGMAX and returns each row's oracle argmax."""
    rows = [make_tokens(20 + 9 * i, seed=950 + i) for i in range(6)]
    scenario = _Scenario(_runtime(tiny_model), rows, [SamplingParams.greedy()] * len(rows))
    batch = scenario.prepare()
    assert [p.sampling_path for p in batch.requests] == [SamplingPath.ARGMAX]
    results = scenario.rt.assemble(scenario.rt.invocations(batch), batch.num_rows)
    for i, tokens in enumerate(rows):
        top2 = oracle.logits(tokens).topk(2).values
        assert top2[0] - top2[1] > 10 * TOL  # the oracle's argmax is unambiguous
        assert results[i].token == int(oracle.logits(tokens).argmax()), f"row {i}"


# ---------------------------------------------------------------- seeded device top-k


TOPK_PARAMS = dict(temperature=0.9, top_k=8, top_p=0.9)


def test_seeded_topk_tokens_repeat_across_runs(tiny_model, prompts):
    """Sixteen seeded top-k rows give the same tokens on a second call and on a runtime with another seed."""
    sampling = [SamplingParams(**TOPK_PARAMS, seed=s) for s in range(16)]
    scenario = _Scenario(_runtime(tiny_model), [prompts[0]] * 16, sampling)
    assert [p.sampling_path for p in scenario.prepare().requests] == [SamplingPath.TOPK]
    first = [r.token for r in scenario.run()]
    assert len(set(first)) > 1  # the seeds do pick different tokens
    assert [r.token for r in scenario.run()] == first
    other = _Scenario(_runtime(tiny_model, seed=1234), [prompts[0]] * 16, sampling)
    assert [r.token for r in other.run()] == first


def test_seeded_topk_token_does_not_depend_on_wave_mates(tiny_model, prompts):
    """A seeded row's token is the same alone, in a wave of clones, and shuffled among rows with other params."""
    params = [SamplingParams(**TOPK_PARAMS, seed=s) for s in range(8)]
    rt = _runtime(tiny_model)
    alone = [_Scenario(rt, [prompts[0]], [p]).run()[0].token for p in params]
    clones = [r.token for r in _Scenario(rt, [prompts[0]] * 8, params).run()]
    assert clones == alone
    mates = [SamplingParams(temperature=1.4, top_k=3, seed=100 + i) for i in range(5)] + [SamplingParams.greedy()] * 2
    rows = [(prompts[0], p, s) for s, p in enumerate(params)] + [
        (prompts[1 + i % 2], p, None) for i, p in enumerate(mates)
    ]
    random.Random(3).shuffle(rows)
    mixed = _Scenario(rt, [r[0] for r in rows], [r[1] for r in rows])
    assert [p.sampling_path for p in mixed.prepare().requests] == [SamplingPath.TOPK]
    results = mixed.run()
    by_seed = {seed: results[i].token for i, (_, _, seed) in enumerate(rows) if seed is not None}
    assert [by_seed[s] for s in range(8)] == alone


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, top_k=3, top_p=1.0),
        dict(temperature=0.7, top_k=20, top_p=0.6),
        dict(temperature=1.8, top_k=32, top_p=0.95),
    ],
    ids=["k3", "k20-p0.6-t0.7", "k32-p0.95-t1.8"],
)
def test_seeded_topk_tokens_stay_inside_oracle_support(tiny_model, oracle, prompts, params):
    """Over 32 seeds, every device-sampled token lies in the top-k/top-p support of the oracle's tempered logits."""
    sampling = [SamplingParams(**params, seed=1000 + s) for s in range(32)]
    rows = [prompts[s % 3] for s in range(32)]
    scenario = _Scenario(_runtime(tiny_model), rows, sampling)
    assert [p.sampling_path for p in scenario.prepare().requests] == [SamplingPath.TOPK]
    results = scenario.run()
    supports = [_support(oracle.logits(p), sampling[0]) for p in prompts]
    assert all(1 < len(s) < VOCAB for s in supports)
    for s, result in enumerate(results):
        assert result.token in supports[s % 3], f"seed {1000 + s}: token {result.token} outside support"
    assert len({r.token for r in results}) > 3  # not collapsed onto the argmax


# ---------------------------------------------------------------- log-probs


LOGPROB_ROWS = {
    "argmax": [SamplingParams.greedy(num_logprobs=n) for n in (0, 1, 5, 20)],
    "topk": [SamplingParams(temperature=1.2, top_k=10, seed=7, num_logprobs=n) for n in (0, 3, 20)]
    + [SamplingParams.greedy(num_logprobs=2)],
    "host": [SamplingParams(temperature=1.0, top_k=0, seed=8, num_logprobs=n) for n in (4, 0, 20, 1)],
}


@pytest.mark.parametrize("path", list(LOGPROB_ROWS))
def test_logprobs_match_oracle_log_softmax_and_top_n(tiny_model, oracle, path):
    """The token's log-prob and the row's top-N (ids and values, N = num_logprobs) equal the oracle's log-softmax."""
    sampling = LOGPROB_ROWS[path]
    rows = [make_tokens(30 + 20 * i, seed=960 + i) for i in range(len(sampling))]
    scenario = _Scenario(_runtime(tiny_model), rows, sampling)
    assert [p.sampling_path.value for p in scenario.prepare().requests] == [path]
    for i, result in enumerate(scenario.run()):
        logp = torch.log_softmax(oracle.logits(rows[i]).double(), dim=-1)
        assert abs(result.logprob - logp[result.token].item()) <= TOL, f"row {i}"
        n = sampling[i].num_logprobs
        assert len(result.top_logprobs) == n, f"row {i}"
        if n:
            values, ids = logp.topk(n)
            assert [t for t, _ in result.top_logprobs] == ids.tolist(), f"row {i}"
            got = torch.tensor([v for _, v in result.top_logprobs], dtype=torch.float64)
            assert max_abs_diff(got, values) <= TOL, f"row {i}"


# ---------------------------------------------------------------- host path


HOST_PARAMS = {
    "top_k-above-cap": dict(temperature=0.8, top_k=50, top_p=0.95),
    "top_k-0": dict(temperature=1.3, top_k=0, top_p=1.0),
}


@pytest.mark.parametrize("name", list(HOST_PARAMS))
def test_host_path_is_classified_host_and_samples_inside_support(tiny_model, oracle, prompts, name):
    """Rows past the device top-k cap or with no top-k limit take the HOST path and sample in the oracle's support."""
    params = HOST_PARAMS[name]
    sampling = [SamplingParams(**params, seed=2000 + s) for s in range(24)]
    rows = [prompts[s % 3] for s in range(24)]
    scenario = _Scenario(_runtime(tiny_model), rows, sampling)
    assert params["top_k"] == 0 or params["top_k"] > CHUNK_256_POLICY.device_top_k_cap
    assert [p.sampling_path for p in scenario.prepare().requests] == [SamplingPath.HOST]
    results = scenario.run()
    supports = [_support(oracle.logits(p), sampling[0]) for p in prompts]
    for s, result in enumerate(results):
        assert result.token in supports[s % 3], f"seed {2000 + s}: token {result.token} outside support"
    assert len({r.token for r in results}) > 3


@pytest.mark.parametrize("name", list(HOST_PARAMS))
def test_host_path_token_is_reproducible_with_its_seed(tiny_model, prompts, name):
    """A host-sampled row gives the same token on a second call, alone, and on a runtime with another seed."""
    sampling = [SamplingParams(**HOST_PARAMS[name], seed=3000 + s) for s in range(8)]
    first = [r.token for r in _Scenario(_runtime(tiny_model), [prompts[1]] * 8, sampling).run()]
    assert len(set(first)) > 1
    rt = _runtime(tiny_model, seed=99)
    assert [r.token for r in _Scenario(rt, [prompts[1]] * 8, sampling).run()] == first
    assert [_Scenario(rt, [prompts[1]], [p]).run()[0].token for p in sampling[:3]] == first[:3]


def test_same_seeded_row_samples_same_token_on_device_and_host_paths(tiny_model, prompts):
    """With top_k 20, a device cap of 32 (TOPK) and of 16 (HOST) give every seeded row the same token."""
    sampling = [SamplingParams(temperature=1.1, top_k=20, top_p=0.9, seed=4000 + s) for s in range(12)]
    device = _Scenario(_runtime(tiny_model), [prompts[2]] * 12, sampling)
    host_policy = attrs.evolve(CHUNK_256_POLICY, device_top_k_cap=16)  # top_k 20 above the cap: the host path
    host = _Scenario(_runtime(tiny_model, policy=host_policy), [prompts[2]] * 12, sampling)
    assert [p.sampling_path for p in device.prepare().requests] == [SamplingPath.TOPK]
    assert [p.sampling_path for p in host.prepare().requests] == [SamplingPath.HOST]
    tokens = [r.token for r in device.run()]
    assert len(set(tokens)) > 1
    assert [r.token for r in host.run()] == tokens
