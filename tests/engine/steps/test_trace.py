"""Traced prefill against eager prefill: bit-identity, one trace per body, streaming, release.

Eager and traced runs write the same KV blocks, so every comparison runs the
eager side on its own runtime over its own pool; both pools start from the
same seeded noise, so a cached prefix reads identical (non-zero) values on
both sides. On CPU a replay re-runs the captured body into the trace's
persistent buffers, so results must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams, WarmupManifest
from prefill_core.values.errors import PrefillStateError
from prefill_shell.backends import TorchBackend
from prefill_shell.device.contract import LOGITS, SAMPLED_TOKENS
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference import random_llama
from tests.helpers import CHUNK_256_POLICY, build_runtime, randomize_pool

VOCAB = 256

LONG_POLICY = PrefillPolicy(max_chunk_length=2048)
"""The default policy: 2048-token chunks, so 5000- and 6000-token rows pad to 8192 and share one chunk body."""

LONG_LAYOUT = PageTableLayout(64, 128, 384)
"""Capacity 8192 tokens; 384 blocks hold one 5000-token row and three 6000-token rows side by side."""

SHORT_LAYOUT = PageTableLayout(16, 64, 320)
"""Capacity 1024 tokens at block size 16."""

# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def model():
    """The seeded tiny preset with positions for 8192 tokens."""
    return random_llama(0, "tiny", max_position_embeddings=8192)


def _runtime(model, policy: PrefillPolicy, layout: PageTableLayout, device: str = "cpu") -> PrefillRuntime:
    """A runtime over a fresh pool filled with the same seeded noise every time."""
    runtime = build_runtime(model, policy=policy, layout=layout, backend=TorchBackend(device))
    randomize_pool(runtime.config.kv, seed=1234)
    return runtime


def _call(lengths, *, block_size: int, cached=None, sampling=None, seed: int = 0) -> dict:
    """Keyword arguments of one prefill call: seeded tokens and disjoint, shuffled blocks per row."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.int64)
    need = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(need), generator=gen).tolist()
    table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
    used = 0
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.randint(1, VOCAB, (n,), generator=gen)
        table[row, : need[row]] = torch.tensor(order[used : used + need[row]], dtype=torch.int32)
        used += need[row]
    return {
        "tokens": tokens,
        "page_table": table,
        "prompt_lengths": list(lengths),
        "cached_lengths": cached,
        "sampling": sampling,
    }


def _warmed(runtime: PrefillRuntime, call: dict) -> PrefillExecutor:
    """An executor warmed with exactly the identities ``call`` uses."""
    executor = PrefillExecutor(runtime)
    executor.warm_up(WarmupManifest().observe(runtime.prepare(**call).requests))
    return executor


def _assert_identical(traced, eager) -> None:
    """Row by row: equal logits bit for bit, or equal token, log-prob and top log-probs."""
    assert [r.row for r in traced] == [r.row for r in eager]
    for t, e in zip(traced, eager):
        if e.logits is not None:
            assert torch.equal(t.logits, e.logits), f"row {e.row}: traced logits differ from eager"
        else:
            assert (t.token, t.logprob, t.top_logprobs) == (e.token, e.logprob, e.top_logprobs), f"row {e.row}"


SAMPLINGS = {
    "logits": None,
    "argmax+logprobs": SamplingParams.greedy(num_logprobs=3),
    "topk": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=7, num_logprobs=2),
    "host": SamplingParams(temperature=1.0, top_k=0, seed=11),
}


# ---------------------------------------------------------------- bit-identity


@pytest.mark.parametrize("path", list(SAMPLINGS))
def test_single_row_traced_equals_eager(model, path):
    """A single 100-token row gives the same result traced as eager on every sampling path."""
    call = _call([100], block_size=16, sampling=[SAMPLINGS[path]], seed=1)
    traced_rt = _runtime(model, PrefillPolicy(), SHORT_LAYOUT)
    executor = _warmed(traced_rt, call)
    traced = executor.prefill(**call, mode="traced")
    eager = _runtime(model, PrefillPolicy(), SHORT_LAYOUT).prefill(**call)
    _assert_identical(traced, eager)
    executor.close()


@pytest.mark.parametrize("path", ["logits", "topk"])
def test_wave_of_15_replayed_by_16_row_trace_equals_eager(model, path):
    """Fifteen rows ride one 16-row trace and match eager row for row."""
    lengths = [5 + 8 * i for i in range(15)]
    call = _call(lengths, block_size=16, sampling=[SAMPLINGS[path]] * 15, seed=2)
    traced_rt = _runtime(model, PrefillPolicy(), SHORT_LAYOUT)
    executor = _warmed(traced_rt, call)
    traced = executor.prefill(**call, mode="traced")
    eager = _runtime(model, PrefillPolicy(), SHORT_LAYOUT).prefill(**call)
    _assert_identical(traced, eager)
    (trace,) = executor.runtime.captured_traces()
    assert (trace.signature.padded_batch, trace.replays) == (16, 1)
    executor.close()


LONG_ROWS = ((5000, 0), (6000, 0), (6000, 2048), (6000, 4096))
"""(length, cached) of the long rows: all pad to 8192 and run 2048-token chunks."""


@pytest.fixture(scope="module")
def long_runs(model):
    """One call over ``LONG_ROWS`` run traced (warmed for it) and eagerly on twin pools."""
    call = _call([n for n, _ in LONG_ROWS], block_size=LONG_LAYOUT.block_size, cached=[c for _, c in LONG_ROWS], seed=3)
    traced_rt = _runtime(model, LONG_POLICY, LONG_LAYOUT)
    executor = _warmed(traced_rt, call)
    captures_after_warm_up = traced_rt.backend.captures
    traced = executor.prefill(**call, mode="traced")
    eager = _runtime(model, LONG_POLICY, LONG_LAYOUT).prefill(**call)
    chunks = sum(len(p.request.chunks) for p in traced_rt.prepare(**call).requests)
    yield {
        "traced": traced,
        "eager": eager,
        "executor": executor,
        "chunks": chunks,
        "captures_after_warm_up": captures_after_warm_up,
    }
    executor.close()


def test_chunked_5000_token_row_traced_equals_eager(long_runs):
    """A 5000-token row prefilled in 2048-token chunks gives bit-identical logits traced and eager."""
    _assert_identical(long_runs["traced"][:1], long_runs["eager"][:1])


@pytest.mark.parametrize("row", [1, 2, 3], ids=["cached0", "cached2048", "cached4096"])
def test_cached_6000_token_row_traced_equals_eager(long_runs, row):
    """A 6000-token row with a cached prefix of 0, 2048 or 4096 tokens matches eager bit for bit."""
    _assert_identical(long_runs["traced"][row : row + 1], long_runs["eager"][row : row + 1])


def test_long_rows_at_every_cached_offset_share_one_chunk_trace(long_runs):
    """Every chunk of every long row, whatever its cached offset, replays one captured trace."""
    executor = long_runs["executor"]
    (trace,) = executor.runtime.captured_traces()
    assert long_runs["captures_after_warm_up"] == 1
    assert executor.runtime.backend.captures == 1
    assert trace.replays == long_runs["chunks"] == 3 + 3 + 2 + 1


def test_one_trace_serves_every_chunk_position(model):
    """A four-chunk request captures once and replays that trace at each of its chunk starts."""
    call = _call([1000], block_size=16, seed=4)
    runtime = _runtime(model, CHUNK_256_POLICY, SHORT_LAYOUT)
    executor = _warmed(runtime, call)
    (prepared,) = runtime.prepare(**call).requests
    starts = [chunk.start for chunk in prepared.request.chunks]
    executor.prefill(**call, mode="traced")
    (trace,) = executor.runtime.captured_traces()
    assert starts == [0, 256, 512, 768]
    assert (runtime.backend.captures, trace.replays) == (1, len(starts))
    executor.close()


# ---------------------------------------------------------------- streaming and buffer reuse


def test_kept_results_survive_later_replays_of_a_shared_buffer(model):
    """Results kept across replays that overwrite one alias workspace still equal eager's."""
    policy = PrefillPolicy(batching_enabled=False)
    call = _call([50, 90], block_size=16, seed=5)
    runtime = _runtime(model, policy, SHORT_LAYOUT)
    executor = _warmed(runtime, call)
    batch = runtime.prepare(**call)
    first, second = batch.requests
    assert first.program_signature == second.program_signature  # one alias, one workspace

    invocations = []

    def spy(stream):
        for invocation in stream:
            invocations.append(invocation)
            yield invocation

    kept = list(runtime.stream(spy(executor.invocations(batch, "traced"))))
    eager = _runtime(model, policy, SHORT_LAYOUT).prefill(**call)
    _assert_identical(sorted(kept, key=lambda r: r.row), eager)

    shared = invocations[0].outputs[LOGITS]
    assert invocations[1].outputs[LOGITS] is shared
    assert shared.ownership is Ownership.WORKSPACE
    device_now = shared.value[0]
    assert torch.equal(device_now, kept[1].logits)  # the buffer holds the second replay ...
    assert not torch.equal(device_now, kept[0].logits)  # ... so the first result is a copy
    executor.close()


def test_traced_invocations_share_one_output_storage(model):
    """Two invocations of one alias hand out the same output storage (no per-call allocation)."""
    policy = PrefillPolicy(batching_enabled=False)
    call = _call([40, 70], block_size=16, sampling=[SamplingParams.greedy()] * 2, seed=6)
    runtime = _runtime(model, policy, SHORT_LAYOUT)
    executor = _warmed(runtime, call)
    pointers = []
    for invocation in executor.invocations(runtime.prepare(**call), "traced"):
        pointers.append(invocation.outputs[SAMPLED_TOKENS].value.data_ptr())
        list(runtime.stream([invocation]))
    assert len(pointers) == 2 and pointers[0] == pointers[1]
    executor.close()


# ---------------------------------------------------------------- release


def test_replay_after_release_trace_raises_state_error(model):
    """A traced call whose trace was released by the backend raises ``PrefillStateError``."""
    call = _call([60], block_size=16, seed=7)
    runtime = _runtime(model, PrefillPolicy(), SHORT_LAYOUT)
    executor = _warmed(runtime, call)
    (trace,) = executor.runtime.captured_traces()
    runtime.backend.release_trace(trace.handle)
    with pytest.raises(PrefillStateError, match="released"):
        executor.prefill(**call, mode="traced")
    executor.close()


def test_replaying_a_trace_handle_after_close_raises_state_error(model):
    """A trace handle kept past ``close`` refuses to replay with ``PrefillStateError``."""
    call = _call([60], block_size=16, seed=8)
    runtime = _runtime(model, PrefillPolicy(), SHORT_LAYOUT)
    executor = _warmed(runtime, call)
    (trace,) = executor.runtime.captured_traces()
    executor.close()
    with pytest.raises(PrefillStateError, match="released"):
        runtime.backend.replay(trace.handle)


def test_traced_prefill_after_close_raises_state_error(model):
    """A traced call on a closed executor raises ``PrefillStateError``, not a coverage error."""
    call = _call([60], block_size=16, seed=9)
    runtime = _runtime(model, PrefillPolicy(), SHORT_LAYOUT)
    executor = _warmed(runtime, call)
    executor.close()
    with pytest.raises(PrefillStateError, match="closed"):
        executor.prefill(**call, mode="traced")


def test_close_leaves_no_live_tensor(model):
    """After traced serving and ``close`` the ledger holds zero live tensors."""
    call = _call([30, 45, 120], block_size=16, sampling=[SamplingParams.greedy(num_logprobs=2)] * 3, seed=10)
    runtime = _runtime(model, PrefillPolicy(), SHORT_LAYOUT)
    executor = _warmed(runtime, call)
    executor.prefill(**call, mode="traced")
    assert runtime.backend.ledger.live()  # traces and workspaces are held until close
    executor.close()
    assert runtime.backend.ledger.live() == []


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_traced_equals_eager_and_captures_a_cuda_graph():
    """On CUDA a traced run matches eager within 1e-4 and its trace is a ``torch.cuda.CUDAGraph``."""
    cuda_model = random_llama(0, "tiny", device="cuda", max_position_embeddings=8192)
    call = _call([100, 37, 128], block_size=16, seed=11)
    traced_rt = _runtime(cuda_model, PrefillPolicy(), SHORT_LAYOUT, device="cuda")
    executor = _warmed(traced_rt, call)
    traced = executor.prefill(**call, mode="traced")
    eager = _runtime(cuda_model, PrefillPolicy(), SHORT_LAYOUT, device="cuda").prefill(**call)
    for t, e in zip(traced, eager):
        assert (t.logits - e.logits).abs().max().item() <= 1e-4
    (trace,) = executor.runtime.captured_traces()
    assert isinstance(trace.handle.payload, torch.cuda.CUDAGraph)
    executor.close()
