"""The whole runtime on a real Tenstorrent device, compared with the torch backend on the same tiny model.

Needs hardware: every test here skips, with the reason, when no chip is
attached (``conftest.hardware_present``). Tolerances are bfloat16's: the
device body computes in bfloat16, the torch twin in float32 on identical
(bfloat16-rounded) weights.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams, WarmupManifest
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.executor import PrefillExecutor
from tests.helpers import build_runtime
from tests.tt.emulated_lanes import POLICY
from tests.tt.tiny_twins import BLOCK, VOCAB, TorchTwin, TtnnTwin, twin_weights
from tests.tt.tt_env import hardware_present
from tests.tt.tt_report import note

pytestmark = pytest.mark.tt_device

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def mesh(ttnn):
    if not hardware_present():
        pytest.skip(
            "no Tenstorrent device attached (/dev/tenstorrent is empty; PREFILL_TT_DEVICE=1 forces these tests)"
        )
    device = ttnn.open_mesh_device(ttnn.MeshShape(1, 1), trace_region_size=32 << 20)
    yield device
    ttnn.close_mesh_device(device)


@pytest.fixture(scope="module")
def weights():
    return twin_weights(0)


def lanes(ttnn, mesh, weights):
    """(ttnn executor, torch executor) over fresh KV pools of the same tiny model."""
    from prefill_shell.tt.backend import TtnnBackend

    out = []
    for model, backend in ((TtnnTwin(ttnn, mesh, weights), TtnnBackend(mesh)), (TorchTwin(weights), TorchBackend())):
        out.append(PrefillExecutor(build_runtime(model, policy=POLICY, backend=backend, kv=model.new_kv(NUM_BLOCKS))))
    return out


def call_args(lengths, cached=None, sampling=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    table = torch.full((len(lengths), 16), -1, dtype=torch.int32)
    block = 1
    for row, length in enumerate(lengths):
        tokens[row, :length] = torch.randint(1, VOCAB, (length,), generator=gen)
        need = -(-length // BLOCK)
        table[row, :need] = torch.arange(block, block + need, dtype=torch.int32)
        block += need
    return dict(
        tokens=tokens,
        page_table=table,
        prompt_lengths=list(lengths),
        cached_lengths=cached,
        sampling=None if sampling is None else [sampling] * len(lengths),
    )


def assert_logits_close(device_results, torch_results, case="logits"):
    worst = 0.0
    for got, want in zip(device_results, torch_results):
        scale = want.logits.abs().max().item()
        diff = (got.logits - want.logits).abs().max().item()
        worst = max(worst, diff)
        assert diff <= 0.03 * scale + 0.05
    note(f"device {case}: max |logit difference| vs torch {worst:.3g} over {len(device_results)} rows")


def report_close(device):
    """Closes the device executor and reports its captures and what stayed live."""
    report_close(device)
    backend = device.runtime.backend
    note(f"device lane: {backend.captures} captures, {len(backend.ledger.live())} live tensors after close")


def test_eager_regular_and_batched_logits_match_the_torch_backend(ttnn, mesh, weights):
    """A single row and a padded wave of three: last-token logits agree within bfloat16 error."""
    device, reference = lanes(ttnn, mesh, weights)
    for lengths in ([100], [100, 70, 128]):
        args = call_args(lengths)
        assert_logits_close(
            device.prefill(**args, mode="eager"), reference.prefill(**args, mode="eager"), f"eager {lengths}"
        )
    report_close(device)


def test_chunked_prefill_and_a_cached_prefix_match_the_torch_backend(ttnn, mesh, weights):
    """A 3-chunk row, then the same row with 256 cached tokens read back from the paged pool."""
    device, reference = lanes(ttnn, mesh, weights)
    full = call_args([300])
    assert_logits_close(device.prefill(**full, mode="eager"), reference.prefill(**full, mode="eager"))
    cached = call_args([300], cached=[256])
    assert_logits_close(device.prefill(**cached, mode="eager"), reference.prefill(**cached, mode="eager"))
    report_close(device)


def test_traced_replay_matches_eager_and_the_torch_backend(ttnn, mesh, weights):
    """Warm a manifest, replay regular and chunked requests from captured traces, compare with torch."""
    device, reference = lanes(ttnn, mesh, weights)
    args = call_args([100, 300])
    batch = device.runtime.prepare(**args)
    device.warm_up(WarmupManifest().observe(batch.requests))
    traced = device.prefill(**args, mode="traced")
    assert_logits_close(traced, reference.prefill(**args, mode="eager"), "traced")
    assert_logits_close(device.prefill(**args, mode="traced"), traced, "second replay")  # same answers
    report_close(device)
    assert device.runtime.backend.ledger.live() == []


def test_device_sampling_picks_the_greedy_token_and_stays_inside_top_k(ttnn, mesh, weights):
    """Greedy rows return the torch argmax (where it is not a near tie); top-k rows a token of the top k."""
    device, reference = lanes(ttnn, mesh, weights)
    args = call_args([100, 90, 60])
    logits = [r.logits for r in reference.prefill(**args, mode="eager")]
    for got, row_logits in zip(
        device.prefill(**call_args([100, 90, 60], sampling=SamplingParams.greedy()), mode="eager"), logits
    ):
        top2 = row_logits.topk(2).values
        if (top2[0] - top2[1]).item() > 0.1:
            assert got.token == int(row_logits.argmax())
    k = 5
    sampled = device.prefill(
        **call_args([100, 90, 60], sampling=SamplingParams(temperature=1.0, top_k=k, seed=7, num_logprobs=2)),
        mode="eager",
    )
    for got, row_logits in zip(sampled, logits):
        allowed = set(row_logits.topk(k + 1).indices.tolist())  # +1: a bfloat16 tie at the k-th place
        assert got.token in allowed
        assert got.logprob <= 0.0 and len(got.top_logprobs) == 2
    report_close(device)
