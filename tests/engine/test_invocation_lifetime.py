"""Invocation lifetime and misuse: overwritten traced outputs, unread invocations, bad indices and row counts."""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, WarmupManifest
from prefill_core.values.errors import PrefillInputError, PrefillStateError
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference import random_llama
from tests.helpers import build_runtime

POLICY = PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,), waves=(1, 2, 4))
"""One 128-token rung and waves up to 4: a whole warm-up manifest (the traced tests) stays cheap on CPU."""
LAYOUT = PageTableLayout(16, 16, 64)


@pytest.fixture(scope="module")
def model():
    return random_llama(0, "tiny")


def _runtime(model) -> PrefillRuntime:
    return build_runtime(model, policy=POLICY, layout=LAYOUT)


def _args(rows: int, seed: int) -> dict:
    """``rows`` rows of 100 seeded tokens, each in its own 7 blocks."""
    tokens = torch.randint(1, 256, (rows, 100), generator=torch.Generator().manual_seed(seed))
    table = torch.arange(rows * 7, dtype=torch.int32).reshape(rows, 7)
    return dict(tokens=tokens, page_table=table, prompt_lengths=[100] * rows)


def _invocation_handles(runtime: PrefillRuntime) -> list:
    return [h for h in runtime.backend.ledger.live() if h.ownership is Ownership.INVOCATION]


@pytest.fixture
def warmed(model):
    """A runtime warmed for one-row 100-token calls, and two such calls (A and B) with different tokens."""
    runtime = _runtime(model)
    executor = PrefillExecutor(runtime)
    a, b = runtime.prepare(**_args(1, seed=1)), runtime.prepare(**_args(1, seed=2))
    executor.warm_up(WarmupManifest().observe(a.requests))
    yield runtime, a, b
    executor.close()


def test_a_traced_invocation_overwritten_by_a_later_replay_is_a_named_error(warmed):
    """Reading A after B replayed into the same workspace raises PrefillStateError; B still reads B's logits."""
    runtime, a, b = warmed
    eager_b = runtime.assemble(runtime.invocations(b), 1)
    first = runtime.invoke(a, 0, mode="traced")
    second = runtime.invoke(b, 0, mode="traced")
    with pytest.raises(PrefillStateError, match="overwritten by a later replay"):
        runtime.assemble([first], 1)
    assert runtime.assemble([second], 1) == eager_b


def test_two_traced_streams_advanced_side_by_side_refuse_the_overwritten_read(warmed):
    """Two traced invocations() generators stepped in turn on one thread: the first one's output is refused."""
    runtime, a, b = warmed
    first = next(runtime.invocations(a, mode="traced"))
    second = next(runtime.invocations(b, mode="traced"))
    with pytest.raises(PrefillStateError, match="overwritten"):
        runtime.assemble([first], 1)
    assert runtime.assemble([second], 1)[0].logits is not None


def test_an_invocation_of_an_abandoned_stream_is_released_by_cleanup(model):
    """A generator advanced once and closed: cleanup() releases its invocation, and reading it is a named error."""
    runtime = _runtime(model)
    batch = runtime.prepare(**_args(1, seed=3))
    stream = runtime.invocations(batch)
    dropped = next(stream)
    stream.close()
    assert _invocation_handles(runtime)  # its logits (and last hidden rows) are still live
    runtime.cleanup()
    assert _invocation_handles(runtime) == [] and runtime.orphans == []
    with pytest.raises(PrefillStateError, match="released unread by cleanup"):
        runtime.assemble([dropped], 1)


def test_close_releases_an_unread_invocation(model):
    """close() releases an invoked but never assembled invocation: no tensor of the runtime stays live."""
    runtime = _runtime(model)
    runtime.invoke(runtime.prepare(**_args(2, seed=4)), 0)
    assert _invocation_handles(runtime)
    runtime.close()
    assert runtime.backend.ledger.live() == []


def test_invoke_refuses_an_index_outside_the_batch_naming_it(model):
    """invoke(batch, 99) and invoke(batch, -1) raise PrefillInputError on field index, running nothing."""
    runtime = _runtime(model)
    batch = runtime.prepare(**_args(1, seed=5))
    before = runtime.backend.ledger.allocations
    for index in (99, -1, "0", True):
        with pytest.raises(PrefillInputError, match=r"index=.*must be an int in \[0, 1\)") as error:
            runtime.invoke(batch, index)
        assert error.value.field == "index"
    assert runtime.backend.ledger.allocations == before


def test_invoke_refuses_what_is_not_a_prepared_batch(model):
    """invoke("x", 0) raises PrefillInputError on field batch, not AttributeError."""
    runtime = _runtime(model)
    with pytest.raises(PrefillInputError, match="must be a PreparedBatch") as error:
        runtime.invoke("x", 0)
    assert error.value.field == "batch"


def test_assemble_with_too_few_rows_is_refused_before_the_read(model):
    """assemble(invocations, num_rows=1) for a 3-row wave raises on num_rows; the invocation stays readable."""
    runtime = _runtime(model)
    batch = runtime.prepare(**_args(3, seed=6))
    assert len(batch.requests) == 1
    invocation = runtime.invoke(batch, 0)
    with pytest.raises(PrefillInputError, match=r"num_rows=1 is invalid.*rows \(0, 1, 2\)") as error:
        runtime.assemble([invocation], num_rows=1)
    assert error.value.field == "num_rows"
    assert [r.row for r in runtime.assemble([invocation], num_rows=3)] == [0, 1, 2]
    for bad in (0, -1, 2.5, None):
        with pytest.raises(PrefillInputError, match="num_rows"):
            runtime.assemble([], bad)


def test_assemble_refuses_foreign_and_non_invocations(model):
    """Another runtime's invocation is a PrefillStateError, a non-invocation a PrefillInputError; both unread."""
    runtime, other = _runtime(model), _runtime(model)
    foreign = other.invoke(other.prepare(**_args(1, seed=7)), 0)
    with pytest.raises(PrefillStateError, match="another PrefillRuntime"):
        runtime.assemble([foreign], 1)
    with pytest.raises(PrefillInputError, match="not an InvocationResult"):
        runtime.assemble(["x"], 1)
    assert other.assemble([foreign], 1)[0].row == 0
