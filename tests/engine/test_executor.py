"""The executor: warm-up from a manifest, serving without compiles or allocations, coverage, order, close.

A compact policy (128-token chunks, waves up to 8) keeps a complete
``manifest_for`` cheap enough to warm on CPU, while a workload still mixes
single rows, batched waves, chunked rows, cached prefixes and every sampling
path.
"""

from __future__ import annotations

import random

import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams, WarmupManifest, manifest_for
from prefill_core.values.errors import PrefillStateError, TraceCoverageError
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference import random_llama
from tests.helpers import CountingModel, build_runtime

VOCAB = 256

POLICY = PrefillPolicy(
    max_chunk_length=128, chunk_quantum=128, length_ladder=(128,), waves=(1, 2, 4, 8), max_batch_size=8, max_logprobs=4
)
"""Rows over 128 tokens (or with a cached prefix) are chunked; waves of up to 8 rows."""

LAYOUT = PageTableLayout(16, 32, 512)
"""Capacity 512 tokens per row, block size 16, a pool deep enough for 12 full rows."""


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def model():
    """The seeded tiny preset."""
    return random_llama(0, "tiny")


def _runtime(model, policy: PrefillPolicy = POLICY, layout: PageTableLayout = LAYOUT) -> PrefillRuntime:
    return build_runtime(model, policy=policy, layout=layout)


def _call(lengths, *, cached=None, sampling=None, seed: int = 0, layout: PageTableLayout = LAYOUT) -> dict:
    """Keyword arguments of one prefill call: seeded tokens and disjoint, shuffled blocks per row."""
    rng = random.Random(seed)
    bs = layout.block_size
    need = [-(-n // bs) for n in lengths]
    blocks = rng.sample(range(layout.num_blocks), sum(need))
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
    used = 0
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.tensor([rng.randrange(1, VOCAB) for _ in range(n)])
        table[row, : need[row]] = torch.tensor(blocks[used : used + need[row]], dtype=torch.int32)
        used += need[row]
    return {
        "tokens": tokens,
        "page_table": table,
        "prompt_lengths": list(lengths),
        "cached_lengths": cached,
        "sampling": sampling,
    }


def _random_sampling(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "greedy+lp", "topk", "topk+lp", "host"])
    seed = rng.randrange(2**31)
    if kind.startswith("greedy"):
        return SamplingParams.greedy(num_logprobs=2 if kind.endswith("lp") else 0)
    if kind.startswith("topk"):
        return SamplingParams(
            temperature=0.7,
            top_k=rng.randrange(2, 33),
            top_p=0.9,
            seed=seed,
            num_logprobs=3 if kind.endswith("lp") else 0,
        )
    return SamplingParams(temperature=1.0, top_k=rng.choice([0, 64]), seed=seed)


def mixed_workload(num_rows: int, seed: int) -> list[dict]:
    """Calls totalling ``num_rows`` rows: mostly short rows in waves, a few long or cached, every sampling path."""
    rng = random.Random(seed)
    calls, total = [], 0
    while total < num_rows:
        n = min(rng.choice([1, 1, 2, 3, 4, 5, 7, 8, 11]), num_rows - total)
        lengths, cached = [], []
        for _ in range(n):
            long = rng.random() < 0.08
            length = rng.randrange(129, LAYOUT.capacity + 1) if long else rng.randrange(1, 129)
            lengths.append(length)
            prefix = rng.random() < 0.1 and length > LAYOUT.block_size
            cached.append(rng.randrange(1, length // LAYOUT.block_size + 1) * LAYOUT.block_size if prefix else 0)
        logits = rng.random() < 0.3
        sampling = None if logits else [_random_sampling(rng) for _ in range(n)]
        calls.append(_call(lengths, cached=cached, sampling=sampling, seed=rng.randrange(2**31)))
        total += n
    return calls


def _ledger_state(runtime: PrefillRuntime) -> tuple[int, list[int]]:
    ledger = runtime.backend.ledger
    return ledger.allocations, sorted(h.id for h in ledger.live())


# ---------------------------------------------------------------- serving after warm-up


@pytest.fixture(scope="module")
def served(model):
    """A runtime warmed with the complete manifest, then 600 mixed rows (over 200 requests) served traced."""
    runtime = _runtime(model)
    executor = PrefillExecutor(runtime)
    executor.warm_up(manifest_for(POLICY, LAYOUT))
    before = {
        "compiles": executor.compile_count,
        "ledger": _ledger_state(runtime),
        "captures": runtime.backend.captures,
    }
    workload = mixed_workload(600, seed=2024)
    results = [executor.prefill(**call, mode="traced") for call in workload]
    after = {"compiles": executor.compile_count, "ledger": _ledger_state(runtime), "captures": runtime.backend.captures}
    yield {"before": before, "after": after, "workload": workload, "results": results, "runtime": runtime}
    executor.close()


def test_workload_mixes_waves_chunks_cached_rows_and_sampling_paths(served):
    """The generated workload really exercises waves, chunked and cached rows and all four sampling paths."""
    runtime = served["runtime"]
    prepared = [p for call in served["workload"] for p in runtime.prepare(**call).requests]
    assert sum(len(r) for r in served["results"]) == 600
    assert len(prepared) >= 200
    assert {p.request.padded_batch for p in prepared} >= {1, 2, 4, 8}
    assert any(len(p.request.chunks) > 1 for p in prepared)
    assert any(c > 0 for call in served["workload"] for c in call["cached_lengths"])
    assert {p.sampling_path.value for p in prepared} == {"logits", "argmax", "topk", "host"}


def test_serving_after_warm_up_compiles_nothing(served):
    """A warmed executor serves over 200 mixed requests traced without compiling or capturing anything."""
    before, after = served["before"], served["after"]
    assert (after["compiles"], after["captures"]) == (before["compiles"], before["captures"])


def test_serving_after_warm_up_allocates_nothing(served):
    """Traced serving leaves the ledger's allocation count and live handles exactly as warm-up left them."""
    assert served["after"]["ledger"] == served["before"]["ledger"]


# ---------------------------------------------------------------- coverage


@pytest.fixture
def half_warmed(model):
    """A counting model's executor warmed for a 100-token row only, and a call adding an uncovered 200-token row."""
    counting = CountingModel(model)
    runtime = _runtime(counting)
    executor = PrefillExecutor(runtime)
    executor.warm_up(WarmupManifest().observe(runtime.prepare(**_call([100], seed=1)).requests))
    call = _call([100, 200], seed=2)
    yield counting, runtime, executor, call
    executor.close()


def test_uncovered_request_raises_coverage_error_naming_key_and_rows(half_warmed):
    """A traced call with an uncovered request raises ``TraceCoverageError`` naming its trace key and rows."""
    _, runtime, executor, call = half_warmed
    uncovered = runtime.prepare(**call).requests[1]
    assert uncovered.request.source_rows == (1,)
    with pytest.raises(TraceCoverageError) as error:
        executor.prefill(**call, mode="traced")
    assert uncovered.trace_signature.key in str(error.value)
    assert "rows (1,)" in str(error.value)


def test_uncovered_request_runs_no_model_body(half_warmed):
    """The coverage check runs before any body, even for the covered request of the same call."""
    counting, _, executor, call = half_warmed
    calls = counting.body_calls
    with pytest.raises(TraceCoverageError):
        executor.prefill(**call, mode="traced")
    assert counting.body_calls == calls


def test_uncovered_request_leaves_ledger_unchanged(half_warmed):
    """A refused traced call allocates and releases nothing."""
    _, runtime, executor, call = half_warmed
    before = _ledger_state(runtime)
    with pytest.raises(TraceCoverageError):
        executor.prefill(**call, mode="traced")
    assert _ledger_state(runtime) == before


def test_auto_mode_runs_uncovered_call_eagerly_with_one_late_compile(half_warmed):
    """mode='auto' runs an uncovered call eagerly and counts one late compile for its unseen program."""
    counting, runtime, executor, call = half_warmed
    unseen = runtime.prepare(**call).requests[1].program_signature
    compiles, calls = executor.compile_count, counting.body_calls
    replays = sum(t.replays for t in executor.runtime.captured_traces())
    results = executor.prefill(**call, mode="auto")
    assert [r.row for r in results] == [0, 1]
    assert executor.compile_count == compiles + 1 and unseen in executor.compiled
    assert counting.body_calls > calls
    assert sum(t.replays for t in executor.runtime.captured_traces()) == replays


# ---------------------------------------------------------------- warm-up order


@pytest.fixture
def recorded_warm_up(model):
    """Events of a warm-up over a multi-trace manifest: ('compile', sig), ('capture', key), ('alloc', ownership)."""
    policy = PrefillPolicy(
        max_chunk_length=128, chunk_quantum=128, length_ladder=(128,), waves=(1, 2, 4), max_batch_size=4
    )
    layout = PageTableLayout(16, 16, 64)
    runtime = _runtime(model, policy, layout)
    runtime.backend.compiles_programs = True  # as a device that builds a program per shape: the order is the point
    executor = PrefillExecutor(runtime)
    events: list[tuple[str, object]] = []
    backend, ledger = runtime.backend, runtime.backend.ledger
    compile_, capture, register = executor.compile, backend.capture, ledger.register

    def recording_compile(signature):
        events.append(("compile", signature))
        return compile_(signature)

    def recording_capture(key, body):
        events.append(("capture", key))
        return capture(key, body)

    def recording_register(value, name, ownership):
        events.append(("alloc", ownership))
        return register(value, name, ownership)

    executor.compile = recording_compile
    backend.capture = recording_capture
    ledger.register = recording_register
    manifest = manifest_for(policy, layout)
    executor.warm_up(manifest)
    yield events, manifest
    executor.close()


def _first_capture(events) -> int:
    return next(i for i, (kind, _) in enumerate(events) if kind == "capture")


def test_warm_up_compiles_every_program_before_the_first_capture(recorded_warm_up):
    """Every manifest program is compiled, and all of them before the first trace capture."""
    events, manifest = recorded_warm_up
    first = _first_capture(events)
    compiled = [sig for kind, sig in events if kind == "compile"]
    assert set(compiled) == set(manifest.program_signatures)
    assert all(kind != "compile" for kind, _ in events[first:])
    assert sum(kind == "capture" for kind, _ in events) == len(manifest.trace_signatures) > 1


def test_warm_up_allocates_only_trace_buffers_after_the_first_capture(recorded_warm_up):
    """Workspace and transient allocations all precede the first capture; later ones are trace-owned."""
    events, _ = recorded_warm_up
    first = _first_capture(events)
    before = {o for kind, o in events[:first] if kind == "alloc"}
    after = {o for kind, o in events[first:] if kind == "alloc"}
    assert Ownership.WORKSPACE in before and Ownership.INVOCATION in before
    assert after == {Ownership.TRACE}


# ---------------------------------------------------------------- close


def test_stream_opened_before_close_refuses_to_replay_after_it(model):
    """A traced invocation stream that outlives ``close`` raises ``PrefillStateError`` on its next replay."""
    call = _call([20, 30], seed=3)
    runtime = _runtime(
        model, PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,), batching_enabled=False)
    )
    executor = PrefillExecutor(runtime)
    batch = runtime.prepare(**call)
    executor.warm_up(WarmupManifest().observe(batch.requests))
    stream = runtime.stream(executor.invocations(batch, "traced"))
    next(stream)
    executor.close()
    with pytest.raises(PrefillStateError, match="closed"):
        next(stream)
