"""One call at a time: an entry from a second thread while a call is in progress raises at once.

A runtime drives one execution lane (its KV pool, persistent trace inputs,
workspaces that every replay overwrites); a serving engine drives it from
one thread. Each test forces the overlap with a barrier, so it is
deterministic: thread A is parked inside a call while the main thread enters.
"""

from __future__ import annotations

import threading

import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, WarmupManifest
from prefill_core.values.errors import PrefillStateError
from prefill_shell.engine.executor import PrefillExecutor
from tests.helpers import ParkingModel, assign_blocks, build_runtime, make_tokens, page_table, token_matrix

BS, POOL = 16, 64
POLICY = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4), max_logprobs=3)
WAIT = 30  # seconds before a broken test gives up instead of hanging


def _runtime(model):
    parking = ParkingModel(model)
    kv = model.new_kv_cache(POOL, BS)
    return build_runtime(parking, policy=POLICY, layout=PageTableLayout(BS, 16, POOL), kv=kv), parking


def _call(seed):
    lengths = [40, 100]
    rows = [make_tokens(n, seed=seed + i) for i, n in enumerate(lengths)]
    return token_matrix(rows), page_table(assign_blocks(lengths, BS, POOL, seed=seed)), lengths


class _Parked(threading.Thread):
    """Runs ``work`` on its own thread, parks at the model's barrier, keeps the result or error."""

    def __init__(self, parking, work):
        super().__init__(daemon=True)
        self.parking, self.work = parking, work
        self.result = self.error = None

    def run(self):
        self.parking.parked_thread = threading.get_ident()
        try:
            self.result = self.work()
        except BaseException as error:
            self.error = error

    def __enter__(self):
        self.start()
        self.parking.barrier.wait()  # thread A is now inside a model body call
        return self

    def __exit__(self, *exc):
        self.parking.go.set()
        self.join(WAIT)
        assert not self.is_alive() and self.error is None, f"the parked call failed: {self.error!r}"


def test_an_overlapping_prefill_from_another_thread_raises_at_once_and_changes_nothing(tiny_model):
    """While thread A is inside a prefill, the main thread's prefill raises PrefillStateError, changing nothing."""
    rt, parking = _runtime(tiny_model)
    tokens, table, lengths = _call(seed=3000)
    expected = build_runtime(tiny_model, policy=POLICY, layout=PageTableLayout(BS, 16, POOL)).prefill(
        tokens, table, lengths
    )
    other_tokens, other_table, other_lengths = _call(seed=3100)
    with _Parked(parking, lambda: rt.prefill(tokens, table, lengths)) as a:
        allocations, pool = rt.backend.ledger.allocations, rt.config.kv.snapshot().clone()
        with pytest.raises(PrefillStateError, match="in progress on thread"):
            rt.prefill(other_tokens, other_table, other_lengths)
        assert rt.backend.ledger.allocations == allocations
        assert torch.equal(rt.config.kv.snapshot(), pool)
    assert a.result == expected
    assert rt.backend.ledger.live() == []


def _entry_from_another_thread(rt) -> PrefillStateError | None:
    """What ``rt.cleanup()`` raises when called from a fresh thread (None when it is served)."""
    seen = {}

    def other():
        try:
            rt.cleanup()
        except PrefillStateError as error:
            seen["error"] = error

    thread = threading.Thread(target=other, name="other-thread")
    thread.start()
    thread.join(WAIT)
    return seen.get("error")


def test_an_unfinished_stream_holds_the_runtime_until_it_ends(tiny_model):
    """A thread holding an unfinished invocations() generator keeps others out; once it is exhausted others may call."""
    rt, parking = _runtime(tiny_model)
    tokens, table, lengths = _call(seed=3200)
    batch = rt.prepare(tokens, table, lengths)
    stream = rt.invocations(batch)
    first = next(stream)  # the main thread now holds the runtime through the suspended generator
    assert _entry_from_another_thread(rt) is not None, "another thread entered while a stream was unfinished"
    rt.assemble([first, *stream], batch.num_rows)  # the holder itself goes on
    assert _entry_from_another_thread(rt) is None
    assert rt.backend.ledger.live() == []


def test_a_stream_started_inside_hold_keeps_the_runtime_after_the_hold_ends(tiny_model):
    """hold() then a suspended invocations() generator: the runtime stays held past the block until the stream ends."""
    rt, _ = _runtime(tiny_model)
    tokens, table, lengths = _call(seed=3250)
    with rt.hold():
        batch = rt.prepare(tokens, table, lengths)  # a call inside the hold runs in it
        stream = rt.invocations(batch)
        first = next(stream)
        error = _entry_from_another_thread(rt)
        assert error is not None and "other-thread" in str(error) and "MainThread" in str(error)
    assert _entry_from_another_thread(rt) is not None, "the hold ended while its stream was unfinished"
    rt.assemble([first, *stream], batch.num_rows)
    assert _entry_from_another_thread(rt) is None
    assert rt.backend.ledger.live() == []


def test_a_traced_executor_refuses_a_second_thread_during_warm_up_and_serving(tiny_model):
    """Thread A parked in warm-up, then in a traced prefill: the main thread's traced prefill raises both times."""
    rt, parking = _runtime(tiny_model)
    executor = PrefillExecutor(rt)
    tokens, table, lengths = _call(seed=3300)
    manifest = WarmupManifest().observe(rt.prepare(tokens, table, lengths).requests)
    with _Parked(parking, lambda: executor.warm_up(manifest)):
        with pytest.raises(PrefillStateError, match="in progress"):
            executor.prefill(tokens, table, lengths, mode="traced")
    parking.go.clear()
    parking.barrier.reset()
    with _Parked(parking, lambda: executor.prefill(tokens, table, lengths, mode="traced")) as a:
        with pytest.raises(PrefillStateError, match="in progress"):
            executor.prefill(tokens, table, lengths, mode="traced")
    assert a.result == executor.prefill(tokens, table, lengths, mode="eager")
    executor.close()
    assert rt.backend.ledger.live() == []


def test_sequential_calls_from_different_threads_are_served(tiny_model):
    """Without overlap, calls from several threads one after another all succeed (the guard is not thread affinity)."""
    rt, _ = _runtime(tiny_model)
    tokens, table, lengths = _call(seed=3400)
    results = []
    for _ in range(3):
        thread = threading.Thread(target=lambda: results.append(rt.prefill(tokens, table, lengths)))
        thread.start()
        thread.join(WAIT)
    assert len(results) == 3 and results[0] == results[1] == results[2]
