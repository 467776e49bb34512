"""Reliability: fault sweeps, the lifecycle state machine, input fuzzing and boundary errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams, WarmupManifest
from prefill_core.values.errors import PrefillConfigError, PrefillError, PrefillInputError, PrefillStateError
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference import random_llama
from prefill_shell.testing.stateful import run_lifecycle_machine
from prefill_shell.testing.sweep import FAULT_TYPES, SCENARIOS, sweep
from tests.helpers import build_runtime

BLOCK, POOL = 16, 64
POLICY = PrefillPolicy(
    length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4), max_logprobs=3, lane_size=8
)


@pytest.fixture(scope="module")
def tiny_model():
    return random_llama(0, "tiny")


def _runtime(model) -> PrefillRuntime:
    return build_runtime(model, policy=POLICY, layout=PageTableLayout(BLOCK, 16, POOL))


@pytest.mark.parametrize("raises", FAULT_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_every_fault_point_leaves_no_leak_no_corruption_and_a_working_runtime(tiny_model, scenario, raises):
    """Each device call failed in turn: the caller sees it, no leak, no change outside written blocks, serving works."""
    report = sweep(tiny_model, scenario, raises=raises)
    assert report.points_swept == report.fault_points >= 10
    assert report.errors_unchanged == report.faults_raised
    assert report.faults_raised + report.release_faults_kept_as_orphans == report.fault_points
    assert report.runs_with_cleanup_notes > 0
    assert (report.leaked_tensors, report.kv_bytes_corrupted, report.wrong_results_after_fault) == (0, 0, 0)


def test_the_sweep_counts_cached_blocks_as_read_only(tiny_model):
    """A cached scenario's cached-prefix blocks are outside its written blocks: a write there counts as corruption."""
    from prefill_shell.testing.faults import FaultPlan
    from prefill_shell.testing.sweep import _Harness

    scenario = next(s for s in SCENARIOS if s.name == "eager chunked+cached")
    harness = _Harness(tiny_model, scenario, FaultPlan())
    cached_blocks = set(harness.table[1, : scenario.cached[1] // BLOCK].tolist())
    assert cached_blocks and not cached_blocks & harness.written


def test_lifecycle_state_machine_holds_its_invariants():
    """Interleaved prepare/eager/traced/warm-up/layout/fault/cleanup steps keep every invariant."""
    examples = max(4, settings.default.max_examples // 8)
    run_lifecycle_machine(max_examples=examples, stateful_step_count=10)


# -- input fuzzing through PrefillRuntime.prepare ---------------------------------


def _valid_call(draw) -> dict:
    rows = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 64), min_size=rows, max_size=rows))
    need = [-(-n // BLOCK) for n in lengths]
    blocks = draw(st.permutations(range(POOL)))
    table = torch.full((rows, max(need) + 1), 7, dtype=torch.int32)  # stale tails may hold anything
    first = 0
    for row, n in enumerate(need):
        table[row, :n] = torch.tensor(blocks[first : first + n])
        first += n
    sampling = [
        draw(
            st.none()
            | st.builds(
                SamplingParams, top_k=st.integers(0, 50), seed=st.integers(0, 99), num_logprobs=st.integers(0, 3)
            )
        )
        for _ in range(rows)
    ]
    return {
        "tokens": torch.randint(1, 256, (rows, max(lengths))),
        "page_table": table,
        "prompt_lengths": lengths,
        "cached_lengths": [0] * rows,
        "slots": list(range(rows)),
        "sampling": sampling,
    }


def _mutations(call: dict):
    """(description, row or None, field, mutated call) for one broken rule each."""
    rows = len(call["prompt_lengths"])
    last = rows - 1

    def with_(**changes):
        return {**call, **changes}

    def at(name, value, row=last):
        items = list(call[name])
        items[row] = value
        return with_(**{name: items})

    table = call["page_table"]
    for value in (-5, 256):  # the tiny model's vocabulary is 256
        tokens = call["tokens"].clone()
        tokens[last, 0] = value
        yield f"token id {value}", last, "tokens[0]", with_(tokens=tokens)
    yield "float tokens", None, "tokens", with_(tokens=call["tokens"].float())
    yield "1-D tokens", None, "tokens", with_(tokens=call["tokens"][0])
    yield "3-D page table", None, "page_table", with_(page_table=table[None])
    yield "float page table", None, "page_table", with_(page_table=table.float())
    yield "page table rows", None, "page_table", with_(page_table=table[:0])
    yield "lengths count", None, "prompt_lengths", with_(prompt_lengths=call["prompt_lengths"] + [5])
    yield "zero length", last, "length", at("prompt_lengths", 0)
    yield "negative cached", last, "cached", at("cached_lengths", -BLOCK)
    yield "cached past the prompt", last, "cached", at("cached_lengths", call["prompt_lengths"][last] + 1)
    yield "slot beyond lane", last, "slot", at("slots", POLICY.lane_size)
    bad = table.clone()
    bad[last, 0] = -1
    yield "-1 in mapped prefix", last, "blocks[0]", with_(page_table=bad)
    bad = table.clone()
    bad[last, 0] = POOL
    yield "block beyond pool", last, "blocks[0]", with_(page_table=bad)
    for field, value in (
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -1.0),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("num_logprobs", POLICY.max_logprobs + 1),
    ):
        yield f"sampling {field}={value}", last, f"sampling.{field}", at("sampling", SamplingParams(**{field: value}))
    if rows > 1:
        yield "duplicate slot", last, "slot", at("slots", call["slots"][0])
        bad = table.clone()
        bad[last, 0] = table[0, 0]
        yield "block written by two rows", last, "blocks[0]", with_(page_table=bad)


@st.composite
def broken_calls(draw):
    call = _valid_call(draw)
    options = list(_mutations(call))
    return draw(st.sampled_from(options))


@given(case=broken_calls())
def test_malformed_caller_input_raises_a_named_input_error_and_allocates_nothing(tiny_model, case):
    """Every malformed input through prepare raises PrefillInputError naming its row and field; nothing is allocated."""
    description, row, field, call = case
    runtime = _runtime(tiny_model)
    allocations = runtime.backend.ledger.allocations
    with pytest.raises(PrefillInputError) as caught:
        runtime.prepare(**call)
    message = str(caught.value)
    assert field in message, f"{description}: {message}"
    if row is not None:
        assert f"row {row}" in message, f"{description}: {message}"
    assert runtime.backend.ledger.allocations == allocations


@st.composite
def valid_calls(draw):
    return _valid_call(draw)


@given(call=valid_calls())
def test_valid_caller_input_is_never_rejected(tiny_model, call):
    """Inputs that follow every rule always prepare."""
    prepared = _runtime(tiny_model).prepare(**call).requests
    assert sorted(r for p in prepared for r in p.request.source_rows) == list(range(len(call["prompt_lengths"])))


def test_empty_batch_is_a_named_input_error(tiny_model):
    """A call with no rows is refused with PrefillInputError, not a torch error."""
    with pytest.raises(PrefillInputError, match="at least one row"):
        _runtime(tiny_model).prepare(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int32), [])


# -- boundary errors ----------------------------------------------------------------


def _one_row(runtime):
    return runtime.prepare(torch.randint(1, 256, (1, 40)), torch.arange(3, dtype=torch.int32)[None], [40])


def test_calling_a_closed_runtime_raises_a_state_error(tiny_model):
    """A closed runtime refuses work with PrefillStateError."""
    runtime = _runtime(tiny_model)
    runtime.close()
    with pytest.raises(PrefillStateError, match="closed"):
        _one_row(runtime)


def test_replaying_a_released_trace_raises_a_state_error(tiny_model):
    """After its trace is released, a replay is refused with PrefillStateError, not a device crash."""
    runtime = _runtime(tiny_model)
    executor = PrefillExecutor(runtime)
    batch = _one_row(runtime)
    executor.warm_up(WarmupManifest().observe(batch.requests))
    trace = next(iter(executor.runtime.captured_traces()))
    runtime.backend.release_trace(trace.handle)
    with pytest.raises(PrefillStateError, match="released"):
        runtime.assemble(executor.invocations(batch, "traced"), batch.num_rows)


def test_assembling_a_result_twice_raises_a_state_error(tiny_model):
    """An invocation result is read once; a second assemble is a PrefillStateError."""
    runtime = _runtime(tiny_model)
    batch = _one_row(runtime)
    invocation = runtime.invoke(batch, 0)
    runtime.assemble(iter([invocation]), 1)
    with pytest.raises(PrefillStateError, match="already assembled"):
        runtime.assemble(iter([invocation]), 1)


def test_a_layout_beyond_the_ceiling_is_refused_and_changes_nothing(tiny_model):
    """configure_page_table_layout past the KV pool raises PrefillConfigError and keeps the old layout."""
    runtime = _runtime(tiny_model)
    before = runtime.config
    with pytest.raises(PrefillConfigError) as caught:
        runtime.configure_page_table_layout(PageTableLayout(BLOCK, 16, POOL + 1))
    assert isinstance(caught.value, PrefillError)
    assert runtime.config is before


def test_a_policy_top_k_cap_above_the_backends_is_a_config_error(tiny_model):
    """A device top-k cap the backend cannot sample is refused when the config resolves."""
    backend = TorchBackend()
    backend.max_device_top_k = 16
    with pytest.raises(PrefillConfigError, match="max_device_top_k"):
        PrefillRuntimeConfig.resolve(tiny_model, backend, tiny_model.new_kv_cache(POOL, BLOCK), policy=PrefillPolicy())
