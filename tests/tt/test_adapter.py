"""``TtTransformersAdapter``: how the runtime's model calls map onto a tt_transformers-style model.

The model here is a RECORDING fake: it records each call and returns the
input (or zeros) unchanged. Only the mapping is checked, never a value.
"""

from __future__ import annotations

import types

import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_shell.tt import staging as ttnn_staging
from prefill_shell.tt.backend import TtnnBackend
from prefill_shell.config import PrefillRuntimeConfig
from prefill_shell.model import PrefillModel
from prefill_shell.runtime import PrefillRuntime
from prefill_shell.tt.adapter import TtKVCache, TtTransformersAdapter

ARGS = types.SimpleNamespace(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=8, max_seq_len=1024)


class RecordingTtTransformer:
    """Records every call a tt_transformers ``Transformer`` would receive; computes nothing."""

    args = ARGS

    def __init__(self, ttnn):
        self._tt = ttnn
        self.calls: list[tuple[str, object]] = []

    def embd(self, ids):
        self.calls.append(("embd", tuple(ids.shape)))
        n = int(ids.shape[-1])
        return self._tt.from_torch(torch.zeros(1, n, ARGS.dim, dtype=torch.bfloat16), layout=self._tt.TILE_LAYOUT)

    def prefill_rot_mats(self, start, seq_len):
        self.calls.append(("prefill_rot_mats", (start, seq_len)))
        return ("rot_mats", seq_len)

    def ttnn_prefill_forward(self, x, **kwargs):
        self.calls.append(("ttnn_prefill_forward", (tuple(x.shape), kwargs)))
        return x

    def norm(self, x, mode):
        self.calls.append(("norm", mode))
        return x

    def lm_head(self, rows):
        self.calls.append(("lm_head", tuple(rows.shape)))
        b = int(rows.shape[-2])
        zeros = torch.zeros(1, 1, b, ARGS.vocab_size, dtype=torch.bfloat16)
        return self._tt.from_torch(zeros, layout=self._tt.TILE_LAYOUT)


@pytest.fixture
def fake(ttnn):
    return RecordingTtTransformer(ttnn)


@pytest.fixture
def adapter(fake, recording):
    return TtTransformersAdapter(fake, ttnn_module=recording)


KV = TtKVCache(layers=["layer0", "layer1"], block_size=32, num_blocks=64)


def staged(name, host):
    return ttnn_staging.stage_named(name, host)


def forward_kwargs(fake) -> dict:
    return next(payload for name, payload in fake.calls if name == "ttnn_prefill_forward")[1]


def test_the_adapter_is_a_prefill_model_with_a_spec_from_model_args(adapter):
    """spec comes from ModelArgs (dim -> hidden_size, max_seq_len -> max_position...)."""
    assert isinstance(adapter, PrefillModel)
    assert (adapter.spec.vocab_size, adapter.spec.hidden_size, adapter.spec.num_layers) == (64, 32, 2)
    assert (adapter.spec.num_kv_heads, adapter.spec.head_dim, adapter.spec.max_position) == (1, 8, 1024)


def test_regular_prefill_writes_through_the_fill_table_as_page_table(adapter, fake):
    """One row: ids [1,1,1,S] to embd, fill table as page_table, no chunk arguments, whole chunk, post-norm."""
    tokens = staged("tokens", torch.ones(1, 128, dtype=torch.int64))
    start = staged("start", torch.zeros(1, dtype=torch.int64))
    fill = staged("fill_table", torch.tensor([[3, 4, 5, 6]], dtype=torch.int32))
    hidden = adapter.forward_hidden(tokens, start, fill, None, KV)
    assert fake.calls[0] == ("embd", (1, 1, 1, 128))
    kwargs = forward_kwargs(fake)
    assert kwargs["page_table"] is fill and kwargs["chunk_page_table"] is None and kwargs["chunk_start_idx"] is None
    assert kwargs["get_last_token"] == -1 and kwargs["user_id"] == 0 and kwargs["kv_cache"] is KV.layers
    assert kwargs["rot_mats_global"] == ("rot_mats", 128) and "batch_size" not in kwargs
    assert fake.calls[-1] == ("norm", "prefill")
    assert tuple(hidden.shape) == (1, 1, 128, ARGS.dim)


def test_chunked_prefill_reads_the_read_table_and_writes_the_fill_table_from_a_start_tensor(adapter, fake):
    """Chunked: page_table = read table, chunk_page_table = fill table, chunk_start_idx = the start tensor itself."""
    tokens = staged("tokens", torch.ones(1, 128, dtype=torch.int64))
    start = staged("start", torch.tensor([256]))
    fill = staged("fill_table", torch.tensor([[9, 10, 11, 12]], dtype=torch.int32))
    read = staged("read_table", torch.arange(16, dtype=torch.int32).reshape(1, 16))
    adapter.forward_hidden(tokens, start, fill, read, KV)
    kwargs = forward_kwargs(fake)
    assert kwargs["page_table"] is read and kwargs["chunk_page_table"] is fill
    assert kwargs["chunk_start_idx"] is start  # a device tensor: a trace never bakes the chunk start in
    rot = next(payload for name, payload in fake.calls if name == "prefill_rot_mats")
    assert rot[0] is start and rot[1] == 128


def test_a_wave_embeds_its_rows_flat_and_runs_as_batch_by_one_by_s(adapter, fake):
    """B rows: ids viewed as [1,1,1,B*S] for embd, activations as [B,1,S,H], batch_size=B."""
    tokens = staged("tokens", torch.ones(4, 64, dtype=torch.int64))
    start = staged("start", torch.zeros(4, dtype=torch.int64))
    fill = staged("fill_table", torch.full((4, 8), -1, dtype=torch.int32))
    hidden = adapter.forward_hidden(tokens, start, fill, None, KV)
    assert fake.calls[0] == ("embd", (1, 1, 1, 256))
    shape, kwargs = next(payload for name, payload in fake.calls if name == "ttnn_prefill_forward")
    assert shape == (4, 1, 64, ARGS.dim) and kwargs["batch_size"] == 4
    assert tuple(hidden.shape) == (4, 1, 64, ARGS.dim)


def test_lm_head_passes_the_gathered_rows_through(adapter, fake, ttnn):
    """lm_head maps [1,1,B,H] rows to the model's logits unchanged."""
    rows = ttnn.from_torch(torch.zeros(1, 1, 2, ARGS.dim, dtype=torch.bfloat16), layout=ttnn.TILE_LAYOUT)
    logits = adapter.lm_head(rows)
    assert fake.calls == [("lm_head", (1, 1, 2, ARGS.dim))]
    assert tuple(logits.shape) == (1, 1, 2, ARGS.vocab_size)


def test_the_runtime_drives_the_adapter_chunk_by_chunk_on_the_ttnn_backend(adapter, fake, recording):
    """End to end over the recording device: a 300-token row is three forward calls, each with its start tensor."""
    backend = TtnnBackend(recording.mesh, ttnn_module=recording)
    policy = PrefillPolicy(length_ladder=(128,), max_chunk_length=128, chunk_quantum=128)
    runtime = PrefillRuntime(PrefillRuntimeConfig.resolve(adapter, backend, KV, policy=policy))
    table = torch.full((1, 16), -1, dtype=torch.int32)
    table[0, :10] = torch.arange(10, dtype=torch.int32)
    results = runtime.prefill(torch.ones(1, 300, dtype=torch.int64), table, [300])
    forwards = [payload[1] for name, payload in fake.calls if name == "ttnn_prefill_forward"]
    assert len(forwards) == 3
    assert all(kw["chunk_start_idx"] is not None and kw["chunk_page_table"] is not None for kw in forwards)
    assert [name for name, _ in fake.calls].count("lm_head") == 1
    assert results[0].logits.shape == (ARGS.vocab_size,)
    assert backend.ledger.live() == []
