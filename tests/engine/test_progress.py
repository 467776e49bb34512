"""Progress of long operations: warm-up stages and a call's model-body steps, reported in order.

Each stage reports ``done = 0, 1, ..., total`` to ``on_progress``; an error
raised by the callback propagates unchanged and leaves nothing leaked.
"""

from __future__ import annotations

import pytest

from prefill_core import WarmupManifest
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.progress import Progress
from tests.helpers import CHUNK_256_POLICY, assign_blocks, build_runtime, make_tokens, page_table, token_matrix

BS, NUM_BLOCKS = 16, 64


def _call():
    lengths = [600, 40, 50]  # one 3-chunk row and a 2-row wave: 4 body steps
    rows = [make_tokens(n, seed=2200 + i) for i, n in enumerate(lengths)]
    return token_matrix(rows), page_table(assign_blocks(lengths, BS, NUM_BLOCKS, seed=22)), lengths


def _counts(events, stage):
    return [(e.done, e.total) for e in events if e.stage == stage]


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_prefill_reports_each_body_step_in_order(tiny_model, mode):
    """A call of 4 body steps reports prefill done 0..4 of 4, in order, eager and traced."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    executor = PrefillExecutor(rt)
    tokens, table, lengths = _call()
    executor.warm_up(WarmupManifest().observe(rt.prepare(tokens, table, lengths).requests))
    events: list[Progress] = []
    results = executor.prefill(tokens, table, lengths, mode=mode, on_progress=events.append)
    assert _counts(events, "prefill") == [(i, 4) for i in range(5)]
    assert [e.stage for e in events] == ["prefill"] * 5
    details = [e.detail for e in events[1:]]
    assert sorted(details) == [
        "rows (0,) chunk 1/3",
        "rows (0,) chunk 2/3",
        "rows (0,) chunk 3/3",
        "rows (1, 2) chunk 1/1",
    ]
    assert [d for d in details if d.startswith("rows (0,)")] == sorted(d for d in details if d.startswith("rows (0,)"))
    assert results == rt.prefill(tokens, table, lengths)
    executor.close()


def test_runtime_prefill_takes_the_same_callback(tiny_model):
    """PrefillRuntime.prefill reports the same steps as the executor's eager mode."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    events: list[Progress] = []
    rt.prefill(*_call(), on_progress=events.append)
    assert _counts(events, "prefill") == [(i, 4) for i in range(5)]


@pytest.mark.parametrize("compiles", [True, False], ids=["device", "cpu"])
def test_warm_up_reports_its_cost_then_compile_allocate_and_capture_stages(tiny_model, compiles):
    """Warm-up reports its cost first, then each stage 0..total over the programs it compiles (one where the
    backend builds nothing per shape, but the smallest), the workspaces and traces, stage by stage."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    rt.backend.compiles_programs = compiles
    tokens, table, lengths = _call()
    manifest = WarmupManifest().observe(rt.prepare(tokens, table, lengths).requests)
    events: list[Progress] = []
    executor = PrefillExecutor(rt)
    executor.warm_up(manifest, on_progress=events.append)
    programs = len(manifest.program_signatures) if compiles else 1
    traces = len(manifest.trace_signatures)
    assert events[0] == Progress("cost", 0, 0, str(executor.cost(manifest)))
    assert f"compile {programs} bodies" in events[0].detail and f"capture {traces} traces" in events[0].detail
    assert _counts(events, "compile") == [(i, programs) for i in range(programs + 1)]
    assert _counts(events, "capture") == [(i, traces) for i in range(traces + 1)]
    workspaces = _counts(events, "allocate")
    assert workspaces[0] == (0, workspaces[-1][1]) and workspaces[-1][0] == workspaces[-1][1] >= 1
    order = ["cost", "compile", "allocate", "capture"]
    assert [e.stage for e in events] == sorted((e.stage for e in events), key=order.index)
    assert len(rt.captured_traces()) == traces and executor.compiled == set(manifest.program_signatures)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("stop_at", [0, 2, 4])
def test_an_error_in_the_callback_propagates_and_leaks_nothing(tiny_model, stop_at):
    """A callback raising at prefill done=stop_at reaches the caller unchanged, and every tensor is released."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)

    def on_progress(event: Progress) -> None:
        if event.done == stop_at:
            raise _Stop(f"stop at {event.done}")

    with pytest.raises(_Stop, match=f"stop at {stop_at}"):
        rt.prefill(*_call(), on_progress=on_progress)
    assert rt.backend.ledger.live() == [] and rt.orphans == []
    assert len(rt.prefill(*_call())) == 3  # the runtime still serves


def test_an_error_in_a_warm_up_callback_leaks_nothing_after_close(tiny_model):
    """A callback raising during capture propagates; closing the executor releases every trace and workspace."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    executor = PrefillExecutor(rt)
    manifest = WarmupManifest().observe(rt.prepare(*_call()).requests)

    def on_progress(event: Progress) -> None:
        if event.stage == "capture" and event.done == 1:
            raise _Stop("stop in capture")

    with pytest.raises(_Stop):
        executor.warm_up(manifest, on_progress=on_progress)
    assert rt.backend.ledger.live(Ownership.INVOCATION) == []
    executor.close()
    assert rt.backend.ledger.live() == []


def test_progress_is_a_frozen_value():
    """Progress values compare by value and refuse mutation."""
    event = Progress("prefill", 1, 4, "rows (0,) chunk 1/3")
    assert event == Progress("prefill", 1, 4, "rows (0,) chunk 1/3")
    with pytest.raises(AttributeError):
        event.done = 2
