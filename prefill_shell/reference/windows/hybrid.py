"""``HybridLlama``: a reference decoder with its layers in KV groups, as the runtime drives a hybrid model.

The decoder is the reference Llama (Mistral, Ministral, Qwen3 with windows)
or Gemma 3's text decoder (``gemma3.py``); ``load_hybrid_folder`` picks it
from the checkpoint's ``model_type``.

It implements the model protocol with grouped steps: the runtime plans a
hybrid call with ``prefill_core.prepare_grouped`` and hands each step's
``contract.GROUPED_INPUTS`` to ``forward_grouped`` (``windowed.py`` runs
them); a packed call (``prefill_core.prepare_grouped_packed``) hands each
step's ``contract.GROUPED_PACKED_INPUTS`` to ``forward_packed_grouped``
(``packed_windowed.py``). Its pool is a ``GroupedKVCache``; ``forward_hidden``
(one table for every layer) is refused, since no single table is right for
every group.

Eager on the host only: each step reads its starts, first columns and reused
spans on the host (a CPU "replay" re-runs the body, which is fine); under
CUDA graph capture that is a sync, so a capture is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from prefill_core import AttentionLayout, KVBuffers
from prefill_core.values.errors import InvalidLayoutError, PrefillConfigError, field_error
from prefill_shell.reference.gemma.gemma3 import PagedGemma3, text_weights
from prefill_shell.reference.gemma.gemma3_config import Gemma3Spec
from prefill_shell.reference.llama_like.config import GEMMA3_ARCHITECTURES as GEMMA3_TYPES
from prefill_shell.reference.llama_like.config import LlamaSpec, in_folder, read_config_dict, sliding_layers
from prefill_shell.reference.llama_like.llama import PagedLlama
from prefill_shell.reference.loading.weights import _read_shard, _shard_files, load_weights
from prefill_shell.reference.windows.packed_windowed import PackedGroupStep, packed_windowed_attention
from prefill_shell.reference.windows.windowed import GroupedKVCache, GroupTensors, forward_grouped, llama_body

__all__ = ["HybridLlama", "load_hybrid_folder"]


class HybridLlama:
    """A ``PagedLlama`` or ``PagedGemma3`` whose layers fall into ``attention``'s KV groups (windows, block sizes)."""

    packed_steps = True  # forward_packed_grouped: segments end to end through each group's tables

    def __init__(self, model: PagedLlama | PagedGemma3, attention: AttentionLayout):
        if attention.num_layers != model.spec.num_layers:
            msg = f"attention has {attention.num_layers} layers, the model {model.spec.num_layers}"
            raise PrefillConfigError(msg)
        self.model, self.attention = model, attention
        self.spec, self.dtype = model.spec, model.dtype

    def with_attention(self, attention: AttentionLayout) -> HybridLlama:
        """The same decoder and weights with its layers in ``attention``'s groups (vLLM's, at allocation)."""
        return HybridLlama(self.model, attention)

    def new_kv_cache(
        self,
        num_blocks: int,
        block_size: int | None = None,
        *,
        device: torch.device | str | None = None,
        buffers: KVBuffers | None = None,
    ) -> GroupedKVCache:
        """Zeroed KV buffers of ``num_blocks`` blocks, held as ``buffers`` says.

        Without ``block_size`` the buffers default to vLLM's plan
        (``KVBuffers.shared``: groups share buffers, one block-id space, one
        table per group). With it, as every generic entry calls a model
        (``new_kv_cache(num_blocks, block_size)``), a buffer per layer
        (``KVBuffers.per_layer``), so one page table in blocks of
        ``block_size`` serves every group, as it serves a plain model; each
        group's block size must then be ``block_size`` (``InvalidLayoutError``
        naming the group otherwise).
        """
        if block_size is not None:
            _check_one_block_size(self.attention, block_size)
            if buffers is None:
                buffers = KVBuffers.per_layer(self.attention)
        spec = self.spec
        return GroupedKVCache(
            self.attention,
            num_blocks,
            spec.num_kv_heads,
            spec.head_dim,
            buffers=buffers,
            dtype=self.dtype,
            device=self.model.device if device is None else device,
        )

    def forward_hidden(self, tokens, start, fill_table, read_table, kv):
        raise PrefillConfigError("a hybrid model reads one table per KV group: pass group_page_tables to prepare")

    def forward_grouped(self, tokens, start, fill_tables, read_tables, read_from, reused, kv: GroupedKVCache):
        """One padded step; the tables are ``[G, B, W]`` (``contract.GROUPED_INPUTS``). Returns ``[B, S, H]``."""
        if tokens.is_cuda and torch.cuda.is_current_stream_capturing():
            raise PrefillConfigError("HybridLlama steps read their window geometry on the host: not capturable")
        firsts, spans = read_from.tolist(), reused.tolist()
        tables = [
            GroupTensors(
                fill_tables[g],
                None if read_tables is None else read_tables[g],
                tuple(firsts[g]),
                tuple(map(tuple, spans[g])),
            )
            for g in range(len(self.attention.groups))
        ]
        return forward_grouped(self.model, tokens, start, tables, kv)

    def forward_packed_grouped(self, tokens, positions, segments, write_slots, prefix_tables, prefix_from, kv):
        """One packed step (``contract.GROUPED_PACKED_INPUTS``: ``tokens, positions [T]``); returns ``[1, T, H]``."""
        step = PackedGroupStep(segments, write_slots, prefix_tables, prefix_from, kv)

        def attend(i, q, k, v):
            return packed_windowed_attention(self.model, i, q, k, v, step, kv)

        body = llama_body if isinstance(self.model, PagedLlama) else type(self.model).body
        with torch.inference_mode():
            return body(self.model, tokens[None], positions[None], attend)

    def lm_head(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden_rows)


def _check_one_block_size(attention: AttentionLayout, block_size: int) -> None:
    for index, group in enumerate(attention.groups):
        if group.block_size != block_size:
            rule = f"must be the pool's block_size={block_size}: one page table serves every group"
            raise field_error(
                InvalidLayoutError, f"AttentionLayout.groups[{index}]", "block_size", group.block_size, rule
            )


def load_hybrid_folder(
    folder: str | Path,
    *,
    block_size: int,
    sliding_block_size: int | None = None,
    device: torch.device | str = "cpu",
    dtype: str | None = None,
) -> HybridLlama:
    """A Hugging Face folder whose config slides layers, as transformers reads it, as a ``HybridLlama``.

    The window and the sliding layers are transformers' (``config._windowed_layers``:
    Mistral's ``sliding_window`` on every layer, Qwen2/Qwen3's with
    ``use_sliding_window`` on the layers ``layer_types`` or
    ``max_window_layers`` mark); the rest of the config is read as
    ``load_hf_folder`` reads it. A config that slides no layer is a
    ``PrefillConfigError`` (load it with ``load_hf_folder``). A Gemma 3
    folder (``gemma3_text``, or ``gemma3`` with its nested ``text_config``
    and ``language_model.`` weights) loads as a ``PagedGemma3``.
    """
    folder = Path(folder)
    cfg = read_config_dict(folder)
    if cfg.get("model_type") in GEMMA3_TYPES:
        return _load_gemma3(folder, cfg, block_size, sliding_block_size, device, dtype)
    try:
        window, windowed = sliding_layers(cfg)
        plain = {key: value for key, value in cfg.items() if key not in ("layer_types", "use_sliding_window")}
        plain["sliding_window"] = None  # read as full attention; the window lives in the attention layout
        spec = LlamaSpec.from_hf_dict(plain)
    except PrefillConfigError as error:
        raise in_folder(folder, error) from None
    if not windowed:
        raise PrefillConfigError(
            f"{folder}/config.json slides no layer: load it with load_hf_folder (load_model_folder picks for you)"
        )
    layers = spec.num_layers
    model = load_weights(folder, spec, device, dtype)
    types = ["sliding_attention" if i in windowed else "full_attention" for i in range(layers)]
    attention = AttentionLayout.from_layer_types(
        types, sliding_window=window, block_size=block_size, sliding_block_size=sliding_block_size
    )
    return HybridLlama(model, attention)


def _load_gemma3(folder: Path, cfg: dict, block_size: int, sliding_block_size, device, dtype) -> HybridLlama:
    """A Gemma 3 folder's text decoder, its layer types and window as transformers reads them."""
    try:
        spec = Gemma3Spec.from_hf_dict(cfg)
    except PrefillConfigError as error:
        raise in_folder(folder, error) from None
    if dtype is not None:
        spec = attrs.evolve(spec, dtype=dtype)
    weights: dict[str, torch.Tensor] = {}
    for shard in _shard_files(folder):
        weights.update(_read_shard(shard))
    try:
        model = PagedGemma3(spec, text_weights(weights, nested=cfg["model_type"] == "gemma3"), device=device)
    except PrefillConfigError as error:
        raise PrefillConfigError(f"{folder}: {error}") from None
    attention = AttentionLayout.from_layer_types(
        spec.layer_types,
        sliding_window=spec.sliding_window,
        block_size=block_size,
        sliding_block_size=sliding_block_size,
    )
    return HybridLlama(model, attention)
