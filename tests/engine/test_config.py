"""Mismatched configuration fails at once, by name: at ``resolve``, at backend construction or at ``invoke``.

Each case once got through and failed late and obscurely: a pool built for
another model raised a raw ``index_copy_`` error inside the first prefill, a
``max_logprobs`` above the vocabulary failed after KV blocks were written,
and a torch backend on ``mps``/``meta`` ran silently on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy
from prefill_core.values.errors import PrefillConfigError, PrefillStateError
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.reference import PagedKVCache, PagedLlama
from tests.helpers import build_runtime, make_tokens

BLOCKS, BS = 16, 16


def _pool(model, **changes) -> PagedKVCache:
    """A pool shaped for ``model`` with the given fields changed."""
    spec = model.spec
    fields = {
        "num_layers": spec.num_layers,
        "num_blocks": BLOCKS,
        "block_size": BS,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": model.dtype,
    }
    fields.update(changes)
    return PagedKVCache(**fields)


class GeometryOnlyPool:
    """A pool that exposes only its geometry (as a ttnn model's bound pool does)."""

    block_size = BS
    num_blocks = BLOCKS


@pytest.mark.parametrize("field, delta", [("num_layers", 1), ("num_kv_heads", 2), ("head_dim", 8)])
def test_a_pool_built_for_another_model_is_refused_at_resolve(tiny_model, field, delta):
    """A pool whose layers, kv heads or head dim differ from the model spec raises PrefillConfigError naming it."""
    pool = _pool(tiny_model, **{field: getattr(tiny_model.spec, field) + delta})
    with pytest.raises(PrefillConfigError, match=f"kv.{field}"):
        PrefillRuntimeConfig.resolve(tiny_model, TorchBackend(), pool)


def test_a_pool_of_another_dtype_is_refused_at_resolve(tiny_model):
    """A float16 pool for a float32 model raises PrefillConfigError naming kv.dtype and both dtypes."""
    with pytest.raises(PrefillConfigError, match="kv.dtype") as caught:
        PrefillRuntimeConfig.resolve(tiny_model, TorchBackend(), _pool(tiny_model, dtype=torch.float16))
    assert "float16" in str(caught.value) and "float32" in str(caught.value)


def test_a_matching_pool_and_a_geometry_only_pool_are_accepted(tiny_model):
    """The model's own pool and a pool exposing only block_size/num_blocks both resolve."""
    assert PrefillRuntimeConfig.resolve(tiny_model, TorchBackend(), _pool(tiny_model)).kv is not None
    assert PrefillRuntimeConfig.resolve(tiny_model, TorchBackend(), GeometryOnlyPool()).kv is not None


def test_max_logprobs_above_the_vocabulary_is_refused_at_resolve(tiny_model):
    """PrefillPolicy(max_logprobs=300) with a 256-token vocabulary raises PrefillConfigError before any write."""
    kv = tiny_model.new_kv_cache(BLOCKS, BS)
    before = kv.snapshot()
    with pytest.raises(PrefillConfigError, match="max_logprobs"):
        PrefillRuntimeConfig.resolve(tiny_model, TorchBackend(), kv, policy=PrefillPolicy(max_logprobs=300))
    assert torch.equal(kv.snapshot(), before)
    vocab = tiny_model.spec.vocab_size
    policy = PrefillPolicy(max_logprobs=vocab)
    assert PrefillRuntimeConfig.resolve(tiny_model, TorchBackend(), kv, policy=policy).policy.max_logprobs == vocab


@pytest.mark.parametrize("device", ["mps", "meta", "xla", "cuda:x", "tpu"])
def test_a_torch_backend_on_a_device_it_cannot_run_is_refused_at_construction(device):
    """TorchBackend on anything but cpu or an available CUDA device raises PrefillConfigError naming the device."""
    with pytest.raises(PrefillConfigError, match="device"):
        TorchBackend(device)


def test_a_cuda_torch_backend_without_cuda_is_refused_at_construction(monkeypatch):
    """TorchBackend("cuda") where CUDA is unavailable raises PrefillConfigError at once, not at the first call."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PrefillConfigError, match="CUDA"):
        TorchBackend("cuda")


def test_a_cuda_device_index_past_the_last_gpu_is_refused_at_construction():
    """TorchBackend("cuda:N") for N past the last visible GPU raises PrefillConfigError."""
    with pytest.raises(PrefillConfigError, match="cuda"):
        TorchBackend(f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}")


def test_a_cpu_torch_backend_is_accepted_in_every_spelling():
    """ "cpu", torch.device("cpu") and "cpu:0" all build a CPU backend."""
    for device in ("cpu", torch.device("cpu"), "cpu:0"):
        assert TorchBackend(device).device.type == "cpu"


def _pool_bytes(runtime) -> list[torch.Tensor]:
    kv = runtime.config.kv
    return [t.clone() for t in (*kv.keys, *kv.values)]


def _unchanged(runtime, before: list[torch.Tensor]) -> bool:
    kv = runtime.config.kv
    return all(torch.equal(a, b) for a, b in zip(before, (*kv.keys, *kv.values)))


def test_a_batch_prepared_by_another_runtime_is_refused_before_anything_is_written(tiny_model):
    """Invoking runtime A's prepared batch on runtime B raises PrefillStateError and leaves B's pool unchanged."""
    a = build_runtime(tiny_model, num_blocks=BLOCKS, block_size=BS)
    b = build_runtime(tiny_model, num_blocks=BLOCKS, block_size=BS)
    batch = a.prepare(make_tokens(40, seed=1)[None], torch.tensor([[0, 1, 2]], dtype=torch.int32), [40])
    before = _pool_bytes(b)
    with pytest.raises(PrefillStateError, match="another PrefillRuntime"):
        b.invoke(batch, 0)
    assert _unchanged(b, before) and b.backend.ledger.live() == []


def test_a_batch_planned_before_the_layout_shrank_is_refused_before_anything_is_written(tiny_model):
    """After configure_page_table_layout shrinks the pool, a batch writing blocks 12-14 is refused unwritten."""
    runtime = build_runtime(tiny_model, num_blocks=BLOCKS, block_size=BS)
    batch = runtime.prepare(make_tokens(40, seed=2)[None], torch.tensor([[12, 13, 14]], dtype=torch.int32), [40])
    runtime.configure_page_table_layout(PageTableLayout(BS, runtime.config.layout.max_num_blocks_per_seq, 8))
    before = _pool_bytes(runtime)
    with pytest.raises(PrefillStateError, match="prepare it again"):
        runtime.invoke(batch, 0)
    assert _unchanged(runtime, before) and runtime.backend.ledger.live() == []


@pytest.mark.parametrize(("value", "enabled"), [("1", False), ("0", False), ("", True), (None, True)])
def test_disable_batched_prefill_is_read_at_resolve(tiny_model, value, enabled):
    """DISABLE_BATCHED_PREFILL set to anything non-empty turns batching off (tt-transformers reads it so)."""
    environ = {} if value is None else {"DISABLE_BATCHED_PREFILL": value}
    config = PrefillRuntimeConfig.resolve(tiny_model, TorchBackend(), _pool(tiny_model), environ=environ)
    assert config.policy.batching_enabled is enabled


class NarrowSamplingBackend(TorchBackend):
    """A torch backend declaring that one device-sampling call serves at most 4 rows."""

    max_sampled_wave = 4


def test_a_backend_with_narrow_sampled_output_gets_smaller_sampled_waves_not_a_refusal(tiny_model):
    """A policy whose waves exceed the backend's max_sampled_wave resolves with max_sampled_wave capped."""
    policy = PrefillPolicy(waves=(1, 2, 4, 8, 16, 32))
    config = PrefillRuntimeConfig.resolve(tiny_model, NarrowSamplingBackend(), _pool(tiny_model), policy=policy)
    assert config.policy.max_sampled_wave == 4
    assert config.policy.max_wave_for(128, sampled=True) == 4 and config.policy.max_wave_for(128) == 32


class OneRowChunkedLlama(PagedLlama):
    """The reference Llama declaring, as TTTv2's chunked body does, that a chunked step runs one row."""

    chunked_waves = False


def test_cached_rows_run_alone_on_a_model_without_chunked_waves(tiny_model):
    """batch_cached_rows on a model whose chunked step takes one row resolves to False (singles, not a refusal)."""
    policy = PrefillPolicy(batch_cached_rows=True)
    one_row = OneRowChunkedLlama(tiny_model.config, tiny_model.weights)
    assert not PrefillRuntimeConfig.resolve(
        one_row, TorchBackend(), _pool(one_row), policy=policy
    ).policy.batch_cached_rows
    assert PrefillRuntimeConfig.resolve(
        tiny_model, TorchBackend(), _pool(tiny_model), policy=policy
    ).policy.batch_cached_rows
