"""``TtTransformersAdapter``: a tt-metal ``tt_transformers``-style model behind the runtime's model protocol.

The runtime calls ``forward_hidden(tokens, start, fill_table, read_table,
kv)`` and ``lm_head(rows)`` with device tensors staged by ``TtnnBackend``
(``tt/staging.py`` holds the contract). A tt_transformers
``Transformer`` exposes ``embd``, ``ttnn_prefill_forward``, ``norm`` and
``lm_head``; the adapter maps one onto the other:

=========================  ================================================================
runtime (ttnn contract)    tt_transformers call
=========================  ================================================================
tokens uint32 [1,1,B,S]    ``embd(ids [1,1,1,B*S])`` -> ``[1,1,B*S,H]``; a wave is viewed as
                           ``[B,1,S,H]`` (one row: ``[1,1,S,H]``, the stock form)
start int32 [B]            ``rot_mats(start, S)``: rotary matrices for positions
                           ``start .. start+S-1`` read on the device, and, for chunked
                           prefill, ``chunk_start_idx=start`` (tensor form: a trace must
                           not bake the chunk start in)
fill_table int32 [B,Wf]    regular: ``page_table`` (``paged_fill_cache`` skips -1);
                           chunked: ``chunk_page_table`` (the blocks this chunk writes)
read_table int32 [B,Wr]    chunked only: ``page_table`` (what chunked SDPA reads, all >= 0)
(row of the tables)        ``user_id=0``: the runtime's tables are per wave row, so the
                           batch index into them is the row itself (``batch_size=B``)
kv (``TtKVCache``)         ``kv_cache=kv.layers`` (per layer ``[K, V]`` paged pools)
(whole chunk)              ``get_last_token=-1``: the body returns every position; the
                           backend gathers each row's last token on device afterwards
return                     ``norm(x, mode="prefill")``: the protocol's hidden is post-norm
lm_head(rows [1,1,B,H])    ``lm_head(rows)`` -> logits ``[1,1,B,V]`` (vocab-sharded per
                           device on a multi-chip mesh: pair with ``logits_composer``)
=========================  ================================================================

Stock tt_transformers slices its rotary matrices and passes ``chunk_start_idx``
as host integers; a model wrapped here must accept the tensor forms above
(``rot_mats`` and the ``chunk_start_idx`` tensor), which is what makes one
captured chunk trace serve every chunk position. ``prefill_kwargs`` holds the
whole mapping, so a model version with other keyword names overrides one method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..model import ModelSpec

__all__ = ["TtKVCache", "TtTransformersAdapter", "spec_from_args"]


class TtKVCache:
    """A ttnn model's paged KV pool: per layer ``[K, V]`` device tensors, and its geometry.

    ``block_size`` and ``num_blocks`` are what ``PrefillRuntimeConfig`` checks
    the page-table layout against.
    """

    def __init__(self, layers: list, block_size: int, num_blocks: int):
        self.layers = layers
        self.block_size = block_size
        self.num_blocks = num_blocks


def spec_from_args(args: Any, dtype: str = "bfloat16") -> ModelSpec:
    """A ``ModelSpec`` from tt_transformers' ``ModelArgs`` field names."""
    return ModelSpec(
        vocab_size=int(args.vocab_size),
        hidden_size=int(args.dim),
        num_layers=int(args.n_layers),
        num_heads=int(args.n_heads),
        num_kv_heads=int(args.n_kv_heads),
        head_dim=int(args.head_dim),
        max_position=int(args.max_seq_len),
        dtype=dtype,
    )


class TtTransformersAdapter:
    """Implements ``PrefillModel`` over a tt_transformers-style ttnn model (see the module table)."""

    dtype = torch.bfloat16
    """Host dtype of hidden buffers the runtime sizes; the device form is bfloat16 TILE regardless."""

    def __init__(self, tt_model: Any, *, spec: ModelSpec | None = None,
                 rot_mats: Callable[[Any, int], Any] | None = None, ttnn_module: Any = None):
        if ttnn_module is None:
            import ttnn as ttnn_module  # noqa: PLC0415 (only a ttnn model needs it)
        self.tt = ttnn_module
        self.model = tt_model
        self.spec = spec if spec is not None else spec_from_args(tt_model.args)
        self._rot_mats = rot_mats if rot_mats is not None else tt_model.prefill_rot_mats

    def embed(self, tokens: Any) -> Any:
        """uint32 ``[1, 1, B, S]`` ids -> bfloat16 ``[B, 1, S, H]`` embeddings."""
        tt = self.tt
        b, s = int(tokens.shape[-2]), int(tokens.shape[-1])
        ids = tt.reshape(tokens, (1, 1, 1, b * s))  # row-major: a view
        x = tt.unsqueeze_to_4D(self.model.embd(ids))  # [1, 1, B*S, H]
        return x if b == 1 else tt.reshape(x, (b, 1, s, int(x.shape[-1])))

    def prefill_kwargs(self, start: Any, fill_table: Any, read_table: Any, kv: Any, seq_len: int, batch: int) -> dict:
        """Keyword arguments of ``ttnn_prefill_forward`` for one chunk (the module table, as code)."""
        chunked = read_table is not None
        kwargs = {
            "rot_mats_global": self._rot_mats(start, seq_len),
            "user_id": 0,
            "page_table": read_table if chunked else fill_table,
            "chunk_page_table": fill_table if chunked else None,
            "chunk_start_idx": start if chunked else None,
            "get_last_token": -1,
            "kv_cache": kv.layers,
        }
        if batch > 1:
            kwargs["batch_size"] = batch
        return kwargs

    def forward_hidden(self, tokens: Any, start: Any, fill_table: Any, read_table: Any, kv: Any) -> Any:
        """One chunk of prefill; returns the post-norm hidden states ``[B, 1, S, H]`` (bfloat16 TILE)."""
        b, s = int(tokens.shape[-2]), int(tokens.shape[-1])
        x = self.embed(tokens)
        hidden = self.model.ttnn_prefill_forward(x, **self.prefill_kwargs(start, fill_table, read_table, kv, s, b))
        return self.model.norm(hidden, mode="prefill")

    def lm_head(self, hidden_rows: Any) -> Any:
        """``[1, 1, B, H]`` gathered rows -> logits ``[1, 1, B, V]``."""
        return self.model.lm_head(hidden_rows)
