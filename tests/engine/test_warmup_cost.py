"""Bounded start-up: the CPU runs no compile bodies, a warm-up states its cost before it starts and keeps to it,
and a traced warm-up can be limited to given lengths."""

from __future__ import annotations

import pytest
import torch

from prefill_core import PrefillPolicy, manifest_for
from prefill_core.values.errors import PrefillInputError, TraceCoverageError
from prefill_shell.backends import TorchBackend
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.progress import Progress
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.testing.small import SMALL_BLOCK, SMALL_POLICY
from tests.helpers import CountingModel, build_runtime

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _facade(model, **kwargs) -> ServingFacade:
    facade = ServingFacade(model, TorchBackend(), **kwargs)
    spec = model.spec
    facade.allocate_kv_cache((64, spec.num_kv_heads, SMALL_BLOCK, spec.head_dim), model.dtype, spec.num_layers)
    return facade


def test_the_cpus_compile_phase_runs_one_smallest_body_and_says_so_first(tiny_model):
    """warmup_model_prefill(enable_trace=False) on the CPU with the backend's own policy runs one smallest body
    (the process's one-time start-up; it ran 960 bodies over 1.6 M positions at max_seq_len=1024,
    max_batch_size=8, 10.6 s) and reports that cost before anything; serving afterwards counts no late compile."""
    counting = CountingModel(tiny_model)
    facade = _facade(counting, max_seq_len=1024, max_batch_size=8)
    events: list[Progress] = []
    facade.warmup_model_prefill(
        kv_cache=facade.kv, can_sample_on_device=True, enable_trace=False, on_progress=events.append
    )
    assert counting.body_calls == 1
    assert events[0].stage == "cost" and events[0].detail.startswith("compile 1 bodies (")
    executor = facade.executor
    assert executor.compile_count == 1 and len(executor.compiled) > 900


def test_a_warm_up_runs_and_keeps_what_its_cost_says(tiny_model):
    """On a backend that builds programs per shape, the bodies run equal the cost's compile plus capture
    bodies, and the persistent bytes left (trace and workspace tensors in the ledger) equal its prediction."""
    counting = CountingModel(tiny_model)
    runtime = build_runtime(counting, num_blocks=64, block_size=SMALL_BLOCK, policy=SMALL_POLICY)
    runtime.backend.compiles_programs = True  # as a device
    executor = PrefillExecutor(runtime)
    manifest = manifest_for(SMALL_POLICY, runtime.config.layout)
    cost = executor.cost(manifest)
    executor.warm_up(manifest)
    assert counting.body_calls == cost.compile_bodies + cost.capture_bodies > 0
    live = runtime.backend.ledger.live([Ownership.TRACE, Ownership.WORKSPACE])
    assert sum(handle.value.nbytes for handle in live) == cost.persistent_bytes
    executor.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predicted_bytes_follow_the_model_dtype(tiny_model, dtype):
    """The hidden buffers' share of the prediction is in the model's dtype (bf16 halves it), as the ledger's is."""
    model = tiny_model if dtype is torch.float32 else _bf16(tiny_model)
    runtime = build_runtime(model, num_blocks=64, block_size=SMALL_BLOCK, policy=SMALL_POLICY)
    executor = PrefillExecutor(runtime)
    manifest = manifest_for(SMALL_POLICY, runtime.config.layout)
    executor.warm_up(manifest)
    live = runtime.backend.ledger.live([Ownership.TRACE, Ownership.WORKSPACE])
    assert sum(handle.value.nbytes for handle in live) == executor.cost(manifest).persistent_bytes
    executor.close()


def _bf16(_model):
    from prefill_shell.reference import random_llama

    return random_llama(0, "tiny", dtype="bfloat16")


def test_a_traced_warm_up_limited_to_lengths_captures_only_those(tiny_model, kit):
    """ServingFacade(warmup_lengths=(64,)) captures only 64-token bodies in both phases; a traced call needing
    another length is refused by name, and an unknown length is refused at warm-up."""
    policy = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4))
    facade = _facade(tiny_model, max_seq_len=256, max_batch_size=4, policy=policy, warmup_lengths=(64,))
    for enable_trace in (False, True):
        facade.warmup_model_prefill(kv_cache=facade.kv, can_sample_on_device=False, enable_trace=enable_trace)
    captured = {trace.signature.chunk_length for trace in facade.runtime.captured_traces()}
    assert captured == {64}
    tokens = kit.token_matrix([kit.make_tokens(20, seed=1)])
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(TraceCoverageError):
        facade.prefill_forward(tokens, table, enable_trace=True, prompt_lens=[20], kv_cache=facade.kv)
    other = _facade(tiny_model, max_seq_len=256, max_batch_size=4, policy=policy, warmup_lengths=(100,))
    with pytest.raises(PrefillInputError, match=r"lengths=\[100\] is invalid"):
        other.warmup_model_prefill(kv_cache=other.kv, can_sample_on_device=False, enable_trace=True)
