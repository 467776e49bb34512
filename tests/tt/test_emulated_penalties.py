"""Penalties through the facade on the ttnn emulation: the host path samples the emulated device's logits."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from prefill_shell.serving.facade import ServingFacade
from tests.penalty_reference import reference_penalties
from tests.tt.emulated_lanes import EmulatedLane, call_args


def test_repetition_13_on_the_emulated_backend_takes_the_penalised_argmax(ttnn):
    """Greedy rows with repetition 1.3: tokens are the float64 reference's penalised argmax of the emulated logits."""
    lane = EmulatedLane(ttnn)
    facade = ServingFacade(
        lane.model, lane.backend, max_seq_len=1024, max_batch_size=32, kv_factory=lambda *_: lane.kv, policy=None
    )
    facade.allocate_kv_cache()
    args = call_args([100, 70, 128])
    call = dict(prompt_lens=args["prompt_lengths"], start_pos=[0, 0, 0], kv_cache=lane.kv)
    logits = facade.prefill_forward(args["tokens"], args["page_table"], enable_trace=False, **call)[:, 0]
    rows = 3
    sampling = SimpleNamespace(
        temperature=[0.0] * rows,
        top_k=[1] * rows,
        top_p=[0.0] * rows,
        repetition_penalty=[1.3] * rows,
        num_logprobs=[0] * rows,
    )
    tokens, log_probs = facade.prefill_forward(
        args["tokens"], args["page_table"], enable_trace=False, sampling_params=sampling, **call
    )
    for row, length in enumerate(args["prompt_lengths"]):
        prompt = set(args["tokens"][row, :length].tolist())
        penalised = torch.tensor(reference_penalties(logits[row].double(), prompt, [], 1.3, 0.0, 0.0))
        assert tokens[row].item() == int(penalised.argmax())
        assert abs(log_probs[row].item() - torch.log_softmax(logits[row].double(), -1)[tokens[row]].item()) <= 1e-4
    facade.cleanup()
    assert lane.backend.ledger.live() == []
