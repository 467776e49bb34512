"""``HybridServingFacade``: the serving facade for a model whose layers fall into KV groups (sliding + full).

``allocate_kv_cache_per_layer`` (one spec per layer, checked against the
layer's group), ``prefill_forward`` with ``page_tables_per_layer`` read per
group, vLLM's null block 0 and a warm-up of the groups' manifest, as vLLM's
Tenstorrent plugin at e3fc8494 serves a hybrid model. What the plugin sends,
and prefix caching for windowed models (which the plugin still turns off):
docs/serving.md ("Sliding-window and hybrid models").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prefill_core.errors import PrefillConfigError, PrefillInputError
from prefill_shell.device.notes import add_note
from prefill_shell.serving.facade import ServingFacade, _cast, _kv_heads_per_device

__all__ = ["HybridServingFacade", "VLLM_NULL_BLOCK"]

VLLM_NULL_BLOCK = 0
"""vLLM's ``BlockPool.null_block``: block 0, never written, in every out-of-window entry of a hit."""


class HybridServingFacade(ServingFacade):
    """``ServingFacade`` over a model with ``attention`` (``prefill_core.AttentionLayout``) and grouped steps."""

    def __init__(self, model, backend, **kwargs: Any):
        if getattr(model, "attention", None) is None:
            raise PrefillConfigError(f"{type(self).__name__}: the model has no attention layout (KV groups)")
        kwargs.setdefault("kv_factory", lambda num_blocks, _block_size: model.new_kv_cache(num_blocks))
        super().__init__(model, backend, **kwargs)

    # -- set-up ---------------------------------------------------------
    def allocate_kv_cache_per_layer(self, per_layer_specs: Sequence) -> Any:
        """Builds the grouped pool from one ``(shape, dtype[, tensor index])`` per layer; returns it."""
        num_blocks = self._checked_specs(per_layer_specs)
        self._release()
        try:
            self.kv = self.lanes.build(num_blocks, self.model.attention.groups[0].block_size, self._lane_executor)
        except BaseException as error:
            add_note(error, "allocate_kv_cache_per_layer released the previous pool: none is allocated now")
            raise
        return self.kv

    def allocate_kv_cache(self, kv_cache_shape=None, dtype=None, num_layers=None) -> Any:
        """The plugin's legacy call: one shape for every layer, so every group must have its block size."""
        if kv_cache_shape is None and dtype is None and num_layers is None:
            return super().allocate_kv_cache()
        if kv_cache_shape is None or dtype is None or num_layers is None:
            raise TypeError("kv_cache_shape, dtype, and num_layers must be supplied together")
        if type(num_layers) is not int or num_layers < 0:
            raise PrefillConfigError(f"vLLM's KV num_layers={num_layers!r} is invalid: the model needs an int")
        return self.allocate_kv_cache_per_layer([(kv_cache_shape, dtype)] * num_layers)

    def _checked_specs(self, specs: Sequence) -> int:
        spec, attention = self.model.spec, self.model.attention
        if not isinstance(specs, (list, tuple)) or len(specs) != spec.num_layers:
            count = len(specs) if isinstance(specs, (list, tuple)) else type(specs).__name__
            raise PrefillConfigError(f"per_layer_specs={count} is invalid: the model needs {spec.num_layers} layers")
        heads = _kv_heads_per_device(spec.num_kv_heads, getattr(self.backend, "num_devices", 1))
        num_blocks = None
        for layer, entry in enumerate(specs):
            shape, dtype = (
                (tuple(entry[0]), entry[1]) if isinstance(entry, (list, tuple)) and len(entry) >= 2 else ((), None)
            )
            if len(shape) != 4 or not all(type(d) is int for d in shape) or shape[0] <= 0:
                raise PrefillConfigError(f"per_layer_specs[{layer}] shape={shape!r} is invalid: 4 ints, num_blocks > 0")
            g = attention.group_of(layer)
            want = (
                shape[0] if num_blocks is None else num_blocks,
                heads,
                attention.groups[g].block_size,
                spec.head_dim,
            )
            if shape != want or dtype != self._kv_dtype:
                msg = (
                    f"per_layer_specs[{layer}]=({shape!r}, {dtype}) is invalid: layer {layer} is in KV group {g} "
                    f"(one block-id space for all layers): it needs {want} in {self._kv_dtype}"
                )
                raise PrefillConfigError(msg)
            num_blocks = shape[0]
        return num_blocks

    def _lane_executor(self, model, backend, kv, num_blocks: int, block_size: int, seed: int):
        # The layout's block size is the pool's planning block (the largest group's), whatever vLLM's first.
        return super()._lane_executor(model, backend, kv, num_blocks, kv.block_size, seed)

    # -- the call -------------------------------------------------------
    def _plan_keywords(self, kwargs: dict, num_rows: int) -> dict:
        """Each group's table from ``page_tables_per_layer`` (its first layer's, the call's rows)."""
        tables = kwargs.get("page_tables_per_layer")
        attention = self.model.attention
        if not isinstance(tables, (list, tuple)) or len(tables) != attention.num_layers:
            got = type(tables).__name__ if not isinstance(tables, (list, tuple)) else f"{len(tables)} tables"
            msg = f"page_tables_per_layer={got} is invalid: a hybrid model needs one table per layer"
            raise PrefillInputError(msg, field="page_tables_per_layer")
        groups = []
        for g, group in enumerate(attention.groups):
            first = _rows(tables[group.layers[0]], num_rows, group.layers[0])
            for layer in group.layers[1:]:
                if not torch.equal(_rows(tables[layer], num_rows, layer), first):
                    msg = (
                        f"page_tables_per_layer[{layer}] is invalid: layer {layer} is in KV group {g} with layer "
                        f"{group.layers[0]}, so their tables must hold the same rows"
                    )
                    raise PrefillInputError(msg, field=f"page_tables_per_layer[{layer}]")
            groups.append(first)
        return {"group_page_tables": groups, "null_block": VLLM_NULL_BLOCK}


def _rows(table, num_rows: int, layer: int) -> torch.Tensor:
    """The call's rows of one layer's table (the plugin pads short calls to ``max_num_seqs`` rows)."""
    table = _cast(table, torch.int32)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] < num_rows:
        msg = f"page_tables_per_layer[{layer}] is invalid: must be a 2-D integer tensor of at least {num_rows} rows"
        raise PrefillInputError(msg, field=f"page_tables_per_layer[{layer}]")
    return table[:num_rows]
