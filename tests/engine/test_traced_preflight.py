"""A traced runtime call is refused as a whole, before any request writes KV, when one request lacks a trace."""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, WarmupManifest
from prefill_core.values.errors import TraceCoverageError
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference import random_llama
from tests.helpers import build_runtime

POLICY = PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,), waves=(1, 2))
"""One 128-token rung and waves of 1 and 2: a 100-token row warms one trace, a 200-token row needs another."""
LAYOUT = PageTableLayout(16, 16, 64)


def _kv_bytes(kv) -> list[torch.Tensor]:
    """Every key and value tensor of the pool, as raw bytes (NaN and signed zero compare as stored)."""
    return [t.contiguous().view(torch.uint8).clone() for t in (*kv.keys, *kv.values)]


@pytest.fixture
def half_warmed():
    """A runtime warmed for a lone 100-token row, and a call whose second request (a 200-token row) is not."""
    model = random_llama(0, "tiny")
    runtime = build_runtime(model, policy=POLICY, layout=LAYOUT)
    executor = PrefillExecutor(runtime)
    tokens = torch.randint(1, 256, (2, 200), generator=torch.Generator().manual_seed(0))
    table = torch.arange(2 * 13, dtype=torch.int32).reshape(2, 13)
    warm = runtime.prepare(tokens[:1, :100], table[:1], [100])
    executor.warm_up(WarmupManifest().observe(warm.requests))
    call = dict(tokens=tokens, page_table=table, prompt_lengths=[100, 200])
    yield runtime, runtime.config.kv, call
    executor.close()


def test_traced_prefill_with_an_uncovered_second_request_raises_before_any_kv_write(half_warmed):
    """runtime.prefill(mode="traced"): TraceCoverageError names the second request; the KV pool is byte-identical."""
    runtime, kv, call = half_warmed
    first, second = runtime.prepare(**call).requests
    assert runtime.trace_gap(first) is None and runtime.trace_gap(second) is not None
    before = _kv_bytes(kv)
    with pytest.raises(TraceCoverageError, match=r"rows \(1,\) is not covered"):
        runtime.prefill(**call, mode="traced")
    after = _kv_bytes(kv)
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    # The same call run eagerly does write the first request's blocks: the comparison can fail.
    runtime.prefill(**call)
    assert not all(torch.equal(b, a) for b, a in zip(before, _kv_bytes(kv)))


def test_traced_invocations_preflight_before_the_first_invocation(half_warmed):
    """invocations(mode="traced") raises at its first step, before producing the covered first request."""
    runtime, _, call = half_warmed
    replays = sum(t.replays for t in runtime.captured_traces())
    with pytest.raises(TraceCoverageError):
        next(runtime.invocations(runtime.prepare(**call, mode="traced"), mode="traced"))
    assert sum(t.replays for t in runtime.captured_traces()) == replays
