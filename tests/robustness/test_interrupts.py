"""Interrupts and threads against a careless caller: streams advanced or closed from another thread, Ctrl-C while
lane threads start or are waited for, between packed requests and in a scoring round's LM head. Every wait is a
barrier or an event, so each test is deterministic."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams
from prefill_core.values.errors import PrefillStateError
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.steps.prompt_logprobs import PromptEntries
from prefill_shell.lanes import dispatch as lane_dispatch
from prefill_shell.lanes.group import LaneGroup
from prefill_shell.scoring.scorer import Scorer
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.lane_facade import LaneGroupFacade
from prefill_shell.testing.faults import FaultInjectingBackend, FaultInjectingModel, FaultPlan
from prefill_shell.testing.small import SMALL_POLICY
from tests.helpers import (
    ParkingModel,
    assign_blocks,
    build_runtime,
    make_tokens,
    page_table,
    randomize_pool,
    token_matrix,
)
from tests.lane_kit import PER_LANE, changed_blocks, group_call, lane_runtime, pool_of

BS, POOL = 16, 64
POLICY = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4), max_logprobs=3)
WAIT = 30  # seconds before a broken thread test gives up instead of hanging

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _runtime(model):
    return build_runtime(model, policy=POLICY, layout=PageTableLayout(BS, 16, POOL))


def _call(seed: int = 4000):
    """Two rows the planner runs as two requests (a wave and a chunked row): a stream of two steps."""
    lengths = [40, 100]
    rows = [make_tokens(n, seed=seed + i) for i, n in enumerate(lengths)]
    return token_matrix(rows), page_table(assign_blocks(lengths, BS, POOL, seed=seed)), lengths


def _on_thread(work):
    """``work()``'s result or the error it raised, run on a thread of its own."""
    box = {}

    def run():
        try:
            box["result"] = work()
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=run, name="other-thread")
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive(), "the other thread never finished"
    return box


def _streams(rt, batch):
    """The public streams, by name: each yields what its holder collects into the call's results."""
    executor = PrefillExecutor(rt)
    return {
        "runtime.invocations": lambda: rt.invocations(batch),
        "runtime.stream": lambda: rt.stream(rt.invocations(batch)),
        "executor.invocations": lambda: executor.invocations(batch, mode="eager"),
    }


def _collect(rt, items, num_rows):
    """Rows' results from what a stream yielded (invocations are assembled, results taken as they are)."""
    if items and hasattr(items[0], "row"):
        return sorted(items, key=lambda result: result.row)
    return rt.assemble(items, num_rows)


@pytest.mark.parametrize("kind", ["runtime.invocations", "runtime.stream", "executor.invocations"])
def test_a_stream_advanced_from_another_thread_is_refused_and_goes_on_for_its_holder(tiny_model, kind):
    """next() on a stream from a thread that did not start it raises PrefillStateError; the holder's stream goes on."""
    tokens, table, lengths = _call()
    expected = _runtime(tiny_model).prefill(tokens, table, lengths)
    rt = _runtime(tiny_model)
    batch = rt.prepare(tokens, table, lengths, mode="traced")
    assert len(batch.requests) == 2
    stream = _streams(rt, batch)[kind]()
    first = next(stream)
    other = _on_thread(lambda: next(stream))
    assert isinstance(other.get("error"), PrefillStateError), other
    assert "other-thread" in str(other["error"]) and "MainThread" in str(other["error"])
    assert "error" in _on_thread(rt.cleanup), "the refused next() let go of the holder's runtime"
    rest = list(stream)  # the holder's stream was not ended by the refusal
    assert _collect(rt, [first, *rest], batch.num_rows) == expected
    assert "error" not in _on_thread(rt.cleanup)  # exhausted: the runtime is free again
    assert rt.backend.ledger.live() == []


@pytest.mark.parametrize("kind", ["runtime.invocations", "runtime.stream", "executor.invocations"])
def test_a_suspended_stream_closed_from_another_thread_frees_the_runtime(tiny_model, kind):
    """close() on a suspended stream from another thread ends it: that thread may then call; nothing leaks."""
    tokens, table, lengths = _call(seed=4100)
    rt = _runtime(tiny_model)
    batch = rt.prepare(tokens, table, lengths, mode="traced")
    stream = _streams(rt, batch)[kind]()
    next(stream)
    assert "error" in _on_thread(rt.cleanup)

    def close_then_serve():
        stream.close()
        rt.cleanup()  # the unread invocation of the closed stream goes back
        return rt.prefill(tokens, table, lengths)

    other = _on_thread(close_then_serve)
    assert "error" not in other, other
    assert other["result"] == _runtime(tiny_model).prefill(tokens, table, lengths)
    assert list(stream) == []
    assert rt.backend.ledger.live() == []


ROWS = [(40, 0, None), (70, 0, None), (30, 0, None)]
SLOTS = (PER_LANE + 1, 0, PER_LANE)  # lane 1, lane 0, lane 1


def test_an_interrupt_while_lane_threads_start_waits_for_the_lanes_already_started(tiny_model, monkeypatch):
    """Ctrl-C while a threaded group starts lane 1's thread: the call raises only once lane 0's thread has stopped."""
    call = group_call(ROWS, SLOTS, 2)
    parking = ParkingModel(tiny_model)
    group = LaneGroup(
        [PrefillExecutor(lane_runtime(parking, 0)), PrefillExecutor(lane_runtime(tiny_model, 1))], threaded=True
    )
    started = []

    class Lane(threading.Thread):
        """Lane 0 parks in its model body; starting lane 1 is interrupted. A join lets lane 0 go on."""

        def run(self):
            parking.parked_thread = threading.get_ident()
            super().run()

        def start(self):
            if started:
                parking.barrier.wait()  # lane 0 is inside its model body
                raise KeyboardInterrupt("Ctrl-C while a lane thread starts")
            started.append(self)
            super().start()

        def join(self, timeout=None):
            parking.go.set()
            super().join(WAIT if timeout is None else timeout)

    monkeypatch.setattr(lane_dispatch, "threading", SimpleNamespace(**{**vars(threading), "Thread": Lane}))
    with pytest.raises(KeyboardInterrupt):
        group.prefill(**call.kwargs())
    lane0 = started[0]
    still_running = lane0.is_alive()
    parking.go.set()
    threading.Thread.join(lane0, WAIT)
    assert not still_running, "the call raised while lane 0's thread was still running"
    monkeypatch.undo()
    fresh = LaneGroup([PrefillExecutor(lane_runtime(tiny_model, i)) for i in range(2)])
    assert group.prefill(**call.kwargs()) == fresh.prefill(**call.kwargs())


def test_an_interrupt_while_waiting_for_lane_threads_raises_only_once_every_lane_stopped(tiny_model, monkeypatch):
    """Ctrl-C in the caller's wait for lane 0's thread: the wait goes on until lane 0 stops, then the interrupt
    propagates; the group then serves the call as a fresh group does."""
    call = group_call(ROWS, SLOTS, 2, seed=7)
    parking = ParkingModel(tiny_model)
    group = LaneGroup(
        [PrefillExecutor(lane_runtime(parking, 0)), PrefillExecutor(lane_runtime(tiny_model, 1))], threaded=True
    )
    lanes, joins = [], []

    class Lane(threading.Thread):
        """Lane 0 parks in its model body; the caller's first wait for it is interrupted, the second lets it go."""

        def start(self):
            lanes.append(self)
            super().start()

        def run(self):
            if self is lanes[0]:
                parking.parked_thread = threading.get_ident()
            super().run()

        def join(self, timeout=None):
            joins.append(self)
            if len(joins) == 1:
                parking.barrier.wait()  # lane 0 is inside its model body
                raise KeyboardInterrupt("Ctrl-C while the caller waits for the lanes")
            parking.go.set()
            super().join(WAIT if timeout is None else timeout)

    monkeypatch.setattr(lane_dispatch, "threading", SimpleNamespace(**{**vars(threading), "Thread": Lane}))
    with pytest.raises(KeyboardInterrupt):
        group.prefill(**call.kwargs())
    still_running = [lane.name for lane in lanes if lane.is_alive()]
    parking.go.set()
    for lane in lanes:
        threading.Thread.join(lane, WAIT)
    assert still_running == [] and joins[:2] == [lanes[0], lanes[0]]
    monkeypatch.undo()
    fresh = LaneGroup([PrefillExecutor(lane_runtime(tiny_model, i)) for i in range(2)])
    assert group.prefill(**call.kwargs()) == fresh.prefill(**call.kwargs())


def _packed_runtime(model, plan):
    """A packed-steps runtime over a noisy pool (stray writes show), faulted by ``plan``."""
    kv = model.new_kv_cache(POOL, BS)
    randomize_pool(kv, seed=4300)
    policy = attrs.evolve(SMALL_POLICY, packed_steps=True)
    backend, body = FaultInjectingBackend(TorchBackend(), plan), FaultInjectingModel(model, plan)
    return build_runtime(body, policy=policy, backend=backend, layout=PageTableLayout(BS, 16, POOL), kv=kv)


def test_an_interrupt_between_packed_requests_names_the_row_a_later_request_returns(tiny_model):
    """Packed rows 40 and 60 (64-token steps): step 1 ends row 0 and starts row 1, which request 2 returns.
    Ctrl-C reading request 1 stops the call with row 1 half written: it rides on the error as partial_writes."""
    lengths = [40, 60]
    rows = [make_tokens(n, seed=4400 + i) for i, n in enumerate(lengths)]
    blocks = assign_blocks(lengths, BS, POOL, seed=44)
    call = (token_matrix(rows), page_table(blocks), lengths)
    clean = _packed_runtime(tiny_model, FaultPlan())
    batch = clean.prepare(*call)
    assert [p.request.source_rows for p in batch.requests] == [(0,), (1,)]
    whole = clean.prefill(*call)
    plan = FaultPlan(fail_at=1, kinds=("readback",), raises=KeyboardInterrupt)
    rt = _packed_runtime(tiny_model, plan)
    before = pool_of(rt)
    with pytest.raises(KeyboardInterrupt) as info:
        rt.prefill(*call)
    assert plan.fired is info.value
    assert info.value.partial_writes == {1: tuple(sorted(blocks[1][:2]))}  # positions 0..23: blocks 0 and 1
    after, clean_pool = pool_of(rt), pool_of(clean)
    unnamed = changed_blocks(before, after) - set(info.value.partial_writes[1])
    assert unnamed == set(blocks[0]) and not changed_blocks(clean_pool, after) & unnamed  # only row 0, whole
    plan.arm(None)
    rt.cleanup()
    assert rt.backend.ledger.live() == []
    assert rt.prefill(*call) == whole


def _lm_head_points(model, pairs) -> list[int]:
    """The fault-point numbers (kind ``body``) of each LM-head call a packed scoring call makes."""
    plan = FaultPlan(kinds=("body",))
    Scorer(_packed_runtime(model, plan)).score(pairs)
    return [n for n, what in enumerate(plan.log, start=1) if what == "body:lm_head"]


def test_ctrl_c_in_any_lm_head_call_of_a_scoring_round_leaves_the_scorer_whole(tiny_model):
    """Ctrl-C in each LM-head call of a packed scoring round (prompt log-prob pieces and the last tokens): the error
    names the blocks it may have left partly written, every other changed block is whole, the block pool is full,
    nothing leaks after cleanup, and the same scorer then scores as a fresh one."""
    context = make_tokens(40, seed=4500).tolist()
    pairs = [(context, make_tokens(5, seed=4501).tolist()), (context, make_tokens(70, seed=4502).tolist())]
    points = _lm_head_points(tiny_model, pairs)
    assert len(points) >= 3  # pieces of prompt log-probs and the final heads
    clean = _packed_runtime(tiny_model, FaultPlan())
    expected = Scorer(clean).score(pairs)
    for point in points:
        plan = FaultPlan(fail_at=point, kinds=("body",), raises=KeyboardInterrupt)
        rt = _packed_runtime(tiny_model, plan)
        scorer, before = Scorer(rt), pool_of(rt)
        with pytest.raises(KeyboardInterrupt) as info:
            scorer.score(pairs)
        named = {block for blocks in info.value.partial_writes.values() for block in blocks}
        unnamed = changed_blocks(before, pool_of(rt)) - named
        assert not changed_blocks(pool_of(clean), pool_of(rt)) & unnamed, f"LM-head call {point}"
        assert scorer.pool.available == scorer.pool.size
        plan.arm(None)
        rt.cleanup()
        assert rt.backend.ledger.live() == []
        assert scorer.score(pairs) == expected


FACADE_POLICY = PrefillPolicy(length_ladder=(64,), max_chunk_length=64, chunk_quantum=64, waves=(1, 2), lane_size=2)


def _facade(kind: str, model):
    """A plugin-shaped facade with ``model`` on its (first) lane, its KV pools allocated at vLLM's shape."""
    sizes = dict(max_seq_len=128, policy=FACADE_POLICY)
    if kind == "one lane":
        facade = ServingFacade(model, TorchBackend(), max_batch_size=2, **sizes)
    else:
        facade = LaneGroupFacade([(model, TorchBackend()), (model.inner, TorchBackend())], **sizes)
    spec = model.spec
    facade.allocate_kv_cache((16, spec.num_kv_heads, BS, spec.head_dim), model.dtype, spec.num_layers)
    return facade


@pytest.mark.parametrize("kind", ["one lane", "lane group"])
def test_a_second_threads_prefill_forward_on_one_facade_is_refused_and_changes_nothing(tiny_model, kind):
    """While thread A's prefill_forward is inside a model body, the main thread's is refused with PrefillStateError:
    no KV byte changes, and A's call and the next both return what a fresh facade returns."""
    tokens = token_matrix([make_tokens(60, seed=4600), make_tokens(33, seed=4601)])
    args = (tokens, torch.tensor([[1, 2, 3, 4], [5, 6, 7, -1]], dtype=torch.int32))
    kwargs = dict(enable_trace=False, prompt_lens=torch.tensor([60, 33]), empty_slots=[0, 1])
    want = _facade(kind, ParkingModel(tiny_model)).prefill_forward(*args, **kwargs)
    parking = ParkingModel(tiny_model)
    facade = _facade(kind, parking)

    def pools():
        every = facade.kv if kind == "lane group" else [facade.kv]
        return [t.clone() for kv in every for t in kv.keys + kv.values]

    box = {}

    def work():
        parking.parked_thread = threading.get_ident()
        box["out"] = facade.prefill_forward(*args, **kwargs)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    parking.barrier.wait()  # thread A is inside a model body call
    try:
        before = pools()
        with pytest.raises(PrefillStateError, match="while a call is in progress"):
            facade.prefill_forward(*args, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(before, pools()))
    finally:
        parking.go.set()
        thread.join(WAIT)
    assert torch.equal(box["out"], want)
    assert torch.equal(facade.prefill_forward(*args, **kwargs), want)


def test_ctrl_c_while_an_invocation_takes_its_prompt_logprobs_strands_no_output(tiny_model, monkeypatch):
    """Ctrl-C after a request's steps ran, while its rows take their prompt log-probs (before the invocation is
    recorded): its outputs are released, not stranded where cleanup() cannot find them."""
    tokens, table, lengths = _call(seed=4700)
    rt = _runtime(tiny_model)
    batch = rt.prepare(tokens, table, lengths, sampling=SamplingParams.greedy(prompt_logprobs=1), mode="traced")

    def interrupted(*args):
        raise KeyboardInterrupt("Ctrl-C while entries are taken")

    monkeypatch.setattr(PromptEntries, "take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rt.invoke(batch, 0)
    monkeypatch.undo()
    rt.cleanup()
    assert rt.backend.ledger.live() == []
    assert rt.prefill(tokens, table, lengths) == _runtime(tiny_model).prefill(tokens, table, lengths)


class _PendingThatInterrupts(dict):
    """The assembler's unread invocations; taking one out raises Ctrl-C just after it left."""

    def pop(self, *args):
        super().pop(*args)
        raise KeyboardInterrupt("Ctrl-C as the invocation leaves the unread set")


def test_ctrl_c_as_an_invocation_is_taken_for_reading_strands_no_output(tiny_model):
    """Ctrl-C just after assemble takes an invocation out of the unread set, before its read: its outputs are
    released there (cleanup() can no longer find them), and the runtime serves the next call."""
    tokens, table, lengths = _call(seed=4800)
    rt = _runtime(tiny_model)
    batch = rt.prepare(tokens, table, lengths)
    invocation = rt.invoke(batch, 0)
    rt._assembler.pending = _PendingThatInterrupts(rt._assembler.pending)
    with pytest.raises(KeyboardInterrupt):
        rt.assemble([invocation], batch.num_rows)
    rt._assembler.pending = dict(rt._assembler.pending)
    rt.cleanup()
    assert rt.backend.ledger.live() == []
    assert rt.prefill(tokens, table, lengths) == _runtime(tiny_model).prefill(tokens, table, lengths)


def test_a_traced_scoring_round_is_one_call_to_other_threads(tiny_model):
    """release_traces() from another thread between a round's capture and its replay is refused by name (it
    slipped in and the round failed with a misleading TraceCoverageError); the round scores as a fresh scorer's."""
    layout = PageTableLayout(BS, 256 // BS, POOL)

    def traced_scorer() -> Scorer:
        kv = tiny_model.new_kv_cache(layout.num_blocks, layout.block_size)
        return Scorer(build_runtime(tiny_model, layout=layout, kv=kv), mode="traced")

    scorer, outcomes = traced_scorer(), []
    rt = scorer.runtime
    allocate = rt.allocate_workspace

    def allocate_then_race(signature):
        allocate(signature)

        def other_thread():
            try:
                rt.release_traces()
                outcomes.append("released")
            except PrefillStateError:
                outcomes.append("refused")

        _on_thread(other_thread)

    rt.allocate_workspace = allocate_then_race  # the instance attribute shadows the method for this runtime
    pairs = [(make_tokens(40, seed=1).tolist(), make_tokens(3, seed=2).tolist())]
    assert scorer.score(pairs) == traced_scorer().score(pairs)
    assert outcomes and set(outcomes) == {"refused"}


def test_a_packed_stream_closed_after_its_first_request_names_the_half_written_row(tiny_model):
    """Packed rows 40 and 60: the stream broken off after request 1 leaves row 1 half written with no error;
    the invocation read last names exactly the blocks that changed beyond row 0's own."""
    lengths = [40, 60]
    rows = [make_tokens(n, seed=4900 + i) for i, n in enumerate(lengths)]
    blocks = assign_blocks(lengths, BS, POOL, seed=49)
    rt = _packed_runtime(tiny_model, FaultPlan())
    batch = rt.prepare(token_matrix(rows), page_table(blocks), lengths)
    before = pool_of(rt)
    stream = rt.invocations(batch)
    first = next(stream)
    stream.close()
    assert first.unfinished_writes() == {1: tuple(sorted(blocks[1][:2]))}
    assert changed_blocks(before, pool_of(rt)) - set(blocks[0]) == set(blocks[1][:2])
    rt.cleanup()
    assert rt.backend.ledger.live() == []
