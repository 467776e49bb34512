"""Prompt log-probs through TtnnBackend on the EMULATION equal the torch backend's, eager and traced."""

from __future__ import annotations

import pytest

from prefill_core import SamplingParams, WarmupManifest
from tests.tt.emulated_lanes import EmulatedLane, call_args, torch_executor
from tests.tt.tt_report import note

TOLERANCE = 0.05
"""Absolute, on log-probs of a bfloat16 model (its logits agree to a few bfloat16 ulps)."""


@pytest.fixture
def lanes(ttnn):
    lane = EmulatedLane(ttnn)
    yield lane, torch_executor()
    lane.executor.close()
    assert lane.backend.ledger.live() == []


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_chunked_and_cached_rows_score_their_requested_positions_like_torch(lanes, mode):
    """A 300-token row (three 128-token chunks) from position 40 and a row scored from its cached offset."""
    lane, reference = lanes
    fill = call_args([300, 200])
    lane.executor.prefill(**fill, mode="eager")  # the cached prefix of row 1 in both pools
    reference.prefill(**fill, mode="eager")
    args = call_args([300, 200], cached=[0, 64])
    args["sampling"] = [
        SamplingParams.greedy(prompt_logprobs=2, prompt_start=40),
        SamplingParams.greedy(prompt_logprobs=2),
    ]
    if mode == "traced":
        lane.executor.warm_up(WarmupManifest().observe(lane.executor.runtime.prepare(**args).requests))
    got = lane.executor.prefill(**args, mode=mode)
    want = reference.prefill(**args, mode="eager")
    worst = 0.0
    for g, w, start, length in zip(got, want, (40, 64), (300, 200)):
        assert [e.position for e in g.prompt_logprobs] == list(range(start + 1, length))
        assert [e.token for e in g.prompt_logprobs] == [e.token for e in w.prompt_logprobs]
        for a, b in zip(g.prompt_logprobs, w.prompt_logprobs):
            worst = max(worst, abs(a.logprob - b.logprob))
            assert len(a.top) == 2 and abs(a.top[0][1] - b.top[0][1]) <= TOLERANCE
    assert worst <= TOLERANCE
    pieces = -(-259 // 32) + -(-135 // 32)  # row 0: 259 positions in three chunks, row 1: 135 in two
    assert lane.emu.counts.get("moreh_logsoftmax", 0) >= pieces  # scored on the emulated device, piece by piece
    scored = sum(len(g.prompt_logprobs) for g in got)
    note(f"emulated prompt log-probs ({mode}): max |difference| {worst:.3g} over {scored} positions")
