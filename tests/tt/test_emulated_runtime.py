"""The whole runtime through TtnnBackend + staging + TtModelAdapter + stand-in on the EMULATION, vs the torch backend.

Both lanes run the same bfloat16 reference Llama (tests/tt/emulated_lanes.py).
Logits agree within bfloat16 tolerance; greedy tokens agree where the top-2
margin exceeds it; sampled tokens lie in the allowed set and repeat per
(wave, seed). ``make test-tt`` runs the device twin of this suite.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams, WarmupManifest
from tests.tt.emulated_lanes import TOLERANCE, EmulatedLane, assert_logits_close, call_args, torch_executor
from tests.tt.tt_report import note


@pytest.fixture
def lanes(ttnn):
    lane = EmulatedLane(ttnn)
    yield lane, torch_executor()
    lane.executor.close()
    live = lane.backend.ledger.live()
    note(f"emulated lane: {lane.emu.replays()} trace replays, {len(live)} live tensors after close")
    assert live == []


@pytest.mark.parametrize(
    "case, lengths, cached",
    [
        ("eager single", [100], None),
        ("eager wave of 3", [100, 70, 128], None),
        ("eager chunked 3x128", [300], None),
        ("eager prefix-cached 256", [300], [256]),
    ],
)
def test_eager_logits_match_the_torch_backend(lanes, case, lengths, cached):
    """Regular, batched, chunked and prefix-cached requests: logits within bfloat16 tolerance of torch's."""
    lane, reference = lanes
    if cached:  # the cached prefix must be in both pools: fill it with the same uncached call first
        lane.executor.prefill(**call_args(lengths), mode="eager")
        reference.prefill(**call_args(lengths), mode="eager")
    args = call_args(lengths, cached=cached)
    assert_logits_close(case, lane.executor.prefill(**args, mode="eager"), reference.prefill(**args, mode="eager"))


def test_traced_replays_match_eager_and_the_torch_backend(lanes):
    """A wave and a chunked row replayed from captured traces, twice: torch's logits both times."""
    lane, reference = lanes
    args = call_args([100, 300])
    lane.executor.warm_up(WarmupManifest().observe(lane.executor.runtime.prepare(**args).requests))
    want = reference.prefill(**args, mode="eager")
    assert_logits_close("traced 100 + 3x128", lane.executor.prefill(**args, mode="traced"), want)
    replays = lane.emu.replays()
    other = call_args([100, 300], seed=2)  # new tokens through the same persistent inputs
    assert_logits_close(
        "traced, refreshed", lane.executor.prefill(**other, mode="traced"), reference.prefill(**other, mode="eager")
    )
    assert lane.emu.replays() == replays + 4


def test_greedy_rows_take_device_argmax_and_match_torch(lanes):
    """Argmax tokens equal torch's wherever the top-2 margin exceeds the tolerance."""
    lane, reference = lanes
    greedy = SamplingParams.greedy()
    logits = [r.logits for r in reference.prefill(**call_args([100, 90, 60]), mode="eager")]
    got = lane.executor.prefill(**call_args([100, 90, 60], sampling=greedy), mode="eager")
    assert lane.emu.counts.get("argmax", 0) == 1
    compared = 0
    for result, row in zip(got, logits):
        top2 = row.topk(2).values
        if (top2[0] - top2[1]).item() > TOLERANCE * row.abs().max().item():
            assert result.token == int(row.argmax())
            compared += 1
    assert compared >= 1


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_device_top_k_sampling_stays_in_the_allowed_set_and_repeats_per_seed(lanes, mode):
    """Top-5 sampled tokens lie in torch's top-5 (+1 for a bfloat16 tie); the same (wave, seed) repeats them."""
    lane, reference = lanes
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.95, seed=7, num_logprobs=3)
    args = call_args([100, 90, 60], sampling=params)
    if mode == "traced":
        lane.executor.warm_up(WarmupManifest().observe(lane.executor.runtime.prepare(**args).requests))
    before = lane.emu.counts.get("sampling", 0)
    first = lane.executor.prefill(**args, mode=mode)
    second = lane.executor.prefill(**args, mode=mode)
    want = reference.prefill(**call_args([100, 90, 60]), mode="eager")
    assert lane.emu.counts.get("sampling", 0) == before + 2
    for a, b, w in zip(first, second, want):
        assert a.token == b.token and a.token in set(w.logits.topk(6).indices.tolist())
        logp = torch.log_softmax(w.logits.float(), -1)
        assert abs(a.logprob - logp[a.token].item()) <= 0.05
        assert [i for i, _ in a.top_logprobs][:1] == [int(logp.argmax())]


def test_host_sampled_rows_and_log_probs_follow_the_read_logits(lanes):
    """top_k above the device cap samples on the host from read-back logits: a token of torch's top-40 (ties
    at the 40th kept), its log-prob and its 2 top log-probs those of the reference's log-softmax (bfloat16 slack)."""
    lane, reference = lanes
    params = SamplingParams(temperature=1.0, top_k=40, seed=3, num_logprobs=2)
    got = lane.executor.prefill(**call_args([100, 90], sampling=params), mode="eager")
    want = reference.prefill(**call_args([100, 90]), mode="eager")
    assert lane.emu.counts.get("sampling", 0) == 0
    for g, w in zip(got, want):
        assert g.token in set(w.logits.topk(41).indices.tolist())
        logp = torch.log_softmax(w.logits.float(), -1)
        assert abs(g.logprob - logp[g.token].item()) <= 0.05
        assert len(g.top_logprobs) == 2
        ids, values = [i for i, _ in g.top_logprobs], [v for _, v in g.top_logprobs]
        assert values[0] >= values[1]
        assert all(abs(v - logp[i].item()) <= 0.05 for i, v in g.top_logprobs)
        best = logp.topk(2).values.tolist()
        assert all(abs(v - b) <= 0.05 for v, b in zip(values, best))
        assert ids[0] == int(logp.argmax()) or abs(logp[ids[0]].item() - best[0]) <= 0.05
