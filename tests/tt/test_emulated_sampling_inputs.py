"""Device sampling inputs (K, P, T) on the ttnn EMULATION: refreshed in place when traced, per invocation when eager.

Traced: a top-k program alias's workspace holds K, P and 1/T from warm-up
on; each replay refreshes them in place, so serving allocates nothing.
Eager: each invocation uploads them once, owns them, and releases them.
Tokens are compared with the same bfloat16 model on the torch backend.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams, WarmupManifest
from prefill_shell.device.contract import SAMPLING_INPUTS, TEMPERATURE, TOP_K, TOP_P
from prefill_shell.device.ledger import Ownership
from tests.tt.emulated_lanes import EmulatedLane, call_args, torch_executor

FIRST = SamplingParams(temperature=0.9, top_k=5, top_p=0.95, seed=7, num_logprobs=2)
SECOND = SamplingParams(temperature=0.45, top_k=3, top_p=0.8, seed=11, num_logprobs=2)


@pytest.fixture
def lane(ttnn):
    lane = EmulatedLane(ttnn)
    yield lane
    lane.executor.close()
    assert lane.backend.ledger.live() == []


@pytest.fixture(scope="module")
def torch_logits():
    """Last-token logits of the torch twin for the prompts these tests use (rows 100, 90, 60)."""
    executor = torch_executor()
    logits = [r.logits for r in executor.prefill(**call_args([100, 90, 60]), mode="eager")]
    executor.close()
    return logits


def _workspace_sampling_inputs(lane) -> dict:
    return {h.spec: h for h in lane.backend.ledger.live() if h.spec in SAMPLING_INPUTS}


def _device_values(lane, handle) -> torch.Tensor:
    """What the emulated device tensor holds now, as float32."""
    return lane.emu.ttnn.to_torch(handle.value.host).float().reshape(-1)


def _staged(params: SamplingParams, rows: int) -> dict:
    """The bfloat16-rounded K, P and 1/T a wave of ``rows`` rows sharing ``params`` should hold."""
    return {
        TOP_K: torch.full((rows,), float(params.top_k)),
        TOP_P: torch.full((rows,), params.top_p).bfloat16().float(),
        TEMPERATURE: torch.full((rows,), 1 / params.temperature).bfloat16().float(),
    }


def _assert_allowed(results, logits, params: SamplingParams) -> None:
    """Each token lies in torch's top-k (+1 for a bfloat16 tie)."""
    for result, row in zip(results, logits):
        assert result.token in set(row.topk(params.top_k + 1).indices.tolist()), (result, params)


def test_traced_top_k_refreshes_k_p_t_in_place_with_the_second_calls_values(lane, torch_logits):
    """Two traced calls with other params: the same workspace K/P/1/T tensors hold the second call's values."""
    first_args, second_args = call_args([100, 90, 60], sampling=FIRST), call_args([100, 90, 60], sampling=SECOND)
    lane.executor.warm_up(WarmupManifest().observe(lane.executor.runtime.prepare(**first_args).requests))
    warm = _workspace_sampling_inputs(lane)
    assert set(warm) == set(SAMPLING_INPUTS) and all(h.ownership is Ownership.WORKSPACE for h in warm.values())
    objects = {spec: h.value for spec, h in warm.items()}
    allocations, uploads = lane.backend.ledger.allocations, lane.emu.counts.get("to_device", 0)
    _assert_allowed(lane.executor.prefill(**first_args, mode="traced"), torch_logits, FIRST)
    second = lane.executor.prefill(**second_args, mode="traced")
    assert _workspace_sampling_inputs(lane) == warm
    assert all(warm[spec].value is objects[spec] for spec in SAMPLING_INPUTS)
    rows = int(objects[TOP_K].shape[-1])
    for spec, want in _staged(SECOND, rows).items():
        assert torch.equal(_device_values(lane, warm[spec]), want), spec
    assert lane.backend.ledger.allocations == allocations
    assert lane.emu.counts.get("to_device", 0) == uploads
    _assert_allowed(second, torch_logits, SECOND)
    assert [r.token for r in lane.executor.prefill(**second_args, mode="traced")] == [r.token for r in second]


def test_traced_top_k_serving_after_warm_up_allocates_nothing(lane):
    """After warm-up, traced top-k calls with changing K/P/T leave the ledger and device uploads as they were."""
    args = call_args([100, 90, 60], sampling=FIRST)
    lane.executor.warm_up(WarmupManifest().observe(lane.executor.runtime.prepare(**args).requests))
    ledger = lane.backend.ledger
    before = (ledger.allocations, sorted(h.id for h in ledger.live()), lane.emu.counts.get("to_device", 0))
    sampled = lane.emu.counts.get("sampling", 0)
    waves = [
        [SamplingParams(temperature=1.3, top_k=2, seed=1, num_logprobs=1)] * 3,
        [SamplingParams(temperature=0.7, top_k=32, top_p=0.5, seed=2, num_logprobs=2)] * 3,
        [SamplingParams.greedy(num_logprobs=2), FIRST, SECOND],
    ]  # a greedy row stages as K=1, P=1, T=1
    for seed, sampling in enumerate(waves):
        lane.executor.prefill(**{**call_args([100, 90, 60], seed=seed), "sampling": sampling}, mode="traced")
    assert lane.emu.counts.get("sampling", 0) == sampled + len(waves)
    k = _device_values(lane, _workspace_sampling_inputs(lane)[TOP_K])
    assert k.tolist() == [1.0, FIRST.top_k, SECOND.top_k, 1.0]  # the padding row repeats row 0
    assert (ledger.allocations, sorted(h.id for h in ledger.live()), lane.emu.counts.get("to_device", 0)) == before


def _registrations(lane, monkeypatch) -> list:
    """Every (spec, ownership, device tensor) the backend's ledger registers from now on."""
    events = []
    register = lane.backend.ledger.register

    def recording_register(value, spec, ownership):
        events.append((spec, ownership, value))
        return register(value, spec, ownership)

    monkeypatch.setattr(lane.backend.ledger, "register", recording_register)
    return events


def test_eager_top_k_uploads_k_p_t_once_per_invocation_and_releases_them(lane, monkeypatch):
    """A wave and a 3-chunk row (two invocations): K, P, T uploaded once each per invocation, all freed."""
    args = call_args([100, 90, 60, 300], sampling=FIRST)
    assert len(lane.executor.runtime.prepare(**args).requests) == 2
    reference = torch_executor()
    want = reference.prefill(**{**args, "sampling": None}, mode="eager")
    reference.close()
    events = _registrations(lane, monkeypatch)
    results = lane.executor.prefill(**args, mode="eager")
    uploaded = [(spec, own, value) for spec, own, value in events if spec in SAMPLING_INPUTS]
    assert sorted((spec.name, own) for spec, own, _ in uploaded) == sorted(
        (spec.name, Ownership.INVOCATION) for spec in SAMPLING_INPUTS for _ in range(2)
    )
    assert all(value.freed for _, _, value in uploaded)
    assert lane.backend.ledger.live() == []
    _assert_allowed(results, [w.logits for w in want], FIRST)
    assert [r.token for r in lane.executor.prefill(**args, mode="eager")] == [r.token for r in results]
