"""The batch-shaped path (``assemble_batch``, ``prefill(batched=True)``) returns bit for bit the stacked per-row
results of ``assemble``, in caller order, and reads, releases and refuses as ``assemble`` does."""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams, SamplingPath
from prefill_core.values.errors import InvalidSamplingError
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.testing import FaultInjectingBackend, FaultPlan, InjectedFault
from tests.helpers import CHUNK_256_POLICY, assign_blocks, build_runtime, make_tokens, page_table, token_matrix
from tests.lane_kit import group_call, make_group

BS = 16
NUM_BLOCKS = 96
# Caller order is not plan order: the planner groups rows by sampling path and length; row 1 is chunked (> 256).
LENGTHS = [60, 300, 45, 90, 200, 33, 130, 75]
SAMPLING = [
    SamplingParams(top_k=5, seed=1),  # device top-k
    None,
    SamplingParams.greedy(),
    None,
    SamplingParams(top_k=0, seed=2),  # whole vocabulary: sampled on the host (a wave of its own: longer)
    SamplingParams.greedy(),
    None,
    SamplingParams(temperature=0.5, top_k=8, seed=3),
]


def _call(sampling):
    rows = [make_tokens(n, seed=2100 + i) for i, n in enumerate(LENGTHS)]
    table = page_table(assign_blocks(LENGTHS, BS, NUM_BLOCKS, seed=21))
    return token_matrix(rows), table, LENGTHS, None, None, sampling


def _stacked(results) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What a serving engine built from per-row results before: -1 / NaN where a row holds no such value."""
    tokens = torch.full((len(results),), -1, dtype=torch.int64)
    logprobs = torch.full((len(results),), float("nan"), dtype=torch.float32)
    logits = None
    for row, result in enumerate(results):
        assert result.row == row
        if result.logits is None:
            tokens[row], logprobs[row] = result.token, result.logprob
            continue
        if logits is None:
            logits = torch.full((len(results), result.logits.shape[0]), float("nan"), dtype=torch.float32)
        logits[row] = result.logits
    return tokens, logprobs, logits


def _bits(tensor: torch.Tensor | None):
    """A tensor as its exact bits (floats reinterpreted as int32), so NaN equals NaN and -0.0 differs from 0.0."""
    if tensor is None:
        return None
    return tensor.view(torch.int32) if tensor.dtype == torch.float32 else tensor


def _assert_bit_equal(batch, results) -> None:
    for got, want in zip((batch.tokens, batch.logprobs, batch.logits), _stacked(results)):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("sampling", [[None] * len(LENGTHS), SAMPLING], ids=["logits", "mixed"])
def test_batched_prefill_equals_stacked_prefill_results_in_caller_order(tiny_model, sampling):
    """Several waves and a chunked row, caller order shuffled against plan order: the tensors equal stacked results."""
    executor = PrefillExecutor(build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY))
    call = _call(sampling)
    batch = executor.runtime.prepare(*call)
    plan_order = [row for prepared in batch.requests for row in prepared.request.source_rows]
    assert len(batch.requests) > 1 and plan_order != sorted(plan_order)
    assert any(prepared.request.num_chunks > 1 for prepared in batch.requests)
    executor.runtime.cleanup()
    per_row = executor.prefill(*call, mode="eager")
    _assert_bit_equal(executor.prefill(*call, mode="eager", batched=True), per_row)
    if sampling is SAMPLING:  # logits, device-sampled and host-sampled waves in one call
        paths = {prepared.sampling_path for prepared in batch.requests}
        assert {SamplingPath.LOGITS, SamplingPath.TOPK, SamplingPath.HOST} <= paths
    assert executor.runtime.backend.ledger.live() == []


def test_lane_group_batched_prefill_keeps_caller_order_across_lanes(tiny_model):
    """Rows routed to lanes out of caller order come back as tensors equal to the stacked per-row results."""
    rows = [(40, 0, None), (70, 0, SamplingParams.greedy()), (33, 0, None), (90, 0, SamplingParams(top_k=5, seed=4))]
    call = group_call(rows, slots=(5, 0, 4, 1), num_lanes=2)
    group = make_group(tiny_model, 2)
    per_row = group.prefill(**call.kwargs(), mode="eager")
    _assert_bit_equal(group.prefill(**call.kwargs(), mode="eager", batched=True), per_row)


@pytest.mark.parametrize("which", ["first", "last"])
def test_read_failure_in_assemble_batch_releases_everything_and_keeps_primary_error(tiny_model, which):
    """A failed read propagates unchanged; its outputs are released (a failing release is an orphan and a note)."""
    call = _call(SAMPLING)
    counter = FaultPlan(kinds=("readback", "release"))
    counting = build_runtime(
        tiny_model,
        num_blocks=NUM_BLOCKS,
        block_size=BS,
        policy=CHUNK_256_POLICY,
        backend=FaultInjectingBackend(TorchBackend(), counter),
    )
    batch = counting.prepare(*call)
    counting.assemble_batch(counting.invocations(batch), batch.num_rows)
    reads = [n for n, entry in enumerate(counter.log, 1) if entry.startswith("readback:")]
    assert len(reads) == len(batch.requests) > 1
    plan = FaultPlan(reads[0] if which == "first" else reads[-1], kinds=("readback", "release"), failing_releases=1)
    backend = FaultInjectingBackend(TorchBackend(), plan)
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY, backend=backend)
    batch = rt.prepare(*call)
    with pytest.raises(InjectedFault, match=r"\(readback: ") as info:
        rt.assemble_batch(rt.invocations(batch), batch.num_rows)
    assert info.value is plan.fired
    assert any("injected release failure" in note for note in getattr(info.value, "__notes__", []))
    assert [h.id for h in backend.ledger.live()] == [h.id for h in rt.orphans]
    assert len(rt.orphans) >= 1
    rt.cleanup()
    assert backend.ledger.live() == []


def test_a_row_asking_top_or_prompt_logprobs_is_refused_before_anything_runs(tiny_model):
    """Batched prefill names the row asking what a tensor per row cannot hold; no KV byte changes, nothing is live."""
    executor = PrefillExecutor(build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY))
    kv = executor.runtime.config.kv
    before = [t.clone() for t in kv.keys + kv.values]
    for field, params in (
        ("sampling.num_logprobs", SamplingParams.greedy(num_logprobs=2)),
        ("sampling.prompt_logprobs", SamplingParams.greedy(prompt_logprobs=0)),
    ):
        sampling = list(SAMPLING)
        sampling[6] = params
        with pytest.raises(InvalidSamplingError) as info:
            executor.prefill(*_call(sampling), mode="eager", batched=True)
        assert (info.value.row, info.value.field) == (6, field)
    assert all(torch.equal(a, b) for a, b in zip(before, kv.keys + kv.values))
    assert executor.runtime.backend.ledger.live() == []


def test_assemble_batch_refuses_such_an_invocation_before_reading_it(tiny_model):
    """Called directly, assemble_batch leaves the refused invocation unread; cleanup releases it."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    tokens = make_tokens(50, seed=2200)
    batch = rt.prepare(
        tokens[None], page_table([[7, 8, 9, 10]]), [50], sampling=[SamplingParams.greedy(num_logprobs=1)]
    )
    invocation = rt.invoke(batch, 0)
    with pytest.raises(InvalidSamplingError, match="row 0: sampling.num_logprobs=1"):
        rt.assemble_batch(iter([invocation]), batch.num_rows)
    assert rt.assemble(iter([invocation]), batch.num_rows)[0].top_logprobs  # still unread: assemble serves it
    assert rt.backend.ledger.live() == []
