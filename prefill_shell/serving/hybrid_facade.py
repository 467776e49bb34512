"""``HybridServingFacade``: the serving facade for a model whose layers fall into KV groups (sliding windows).

vLLM's hybrid KV cache manager decides the groups: groups of an equal number
of layers (``prefill_core.kv_groups.kv_grouping``: Gemma 3's sliding, sliding, full is
three groups of one layer), each with its own table and block size, sharing
KV tensors (tensor i holds layer i of every group). The plugin at e3fc8494
hands both over: ``allocate_kv_cache_per_layer`` gets one ``(shape, dtype,
tensor index)`` per layer, ``prefill_forward`` one table per layer
(``page_tables_per_layer``) where there are several groups, and only
``page_table`` (the one group's) where there is one.

So at allocation the facade regroups the model's layers as vLLM does from
the specs' block sizes (or as ``layer_groups`` says), allocates one K and one
V buffer per tensor index (``prefill_core.KVBuffers``; the bytes vLLM
planned), and at each call checks that the layers of a group hold equal
rows. vLLM's null block 0 is the block no window may name. What the plugin
sends, and prefix caching for windowed models: docs/serving.md
("Sliding-window and hybrid models").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from prefill_core import AttentionLayout, KVBuffers, vllm_layer_groups
from prefill_core.values.errors import InvalidLayoutError, PrefillConfigError, PrefillInputError
from prefill_shell.device.notes import add_note
from prefill_shell.serving.facade import ServingFacade, _cast, _kv_heads_per_device
from prefill_shell.serving.lane_facade import LaneGroupFacade

__all__ = ["HybridLaneGroupFacade", "HybridServingFacade", "KVGroups", "VLLM_NULL_BLOCK"]

VLLM_NULL_BLOCK = 0
"""vLLM's ``BlockPool.null_block``: block 0, never written, in every out-of-window entry of a hit."""


class KVGroups:
    """What a facade over a model with KV groups adds to the plugin's calls, over one lane or a lane group.

    The model's layout gives each layer's kind and window; vLLM's specs give
    the block sizes and the groups. ``kv_factory(model, num_blocks, buffers)``
    builds a pool for a regrouped model (default: its
    ``new_kv_cache(num_blocks, buffers=buffers)``), on every lane; a model is
    regrouped by its ``with_attention(layout)``. Mixed into a facade
    (``HybridServingFacade``: one lane; ``HybridLaneGroupFacade``: one lane
    per data-parallel rank), so KV groups and lanes are two independent axes.
    """

    def __init__(self, *args: Any, kv_factory: Callable[..., Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if getattr(self.model, "attention", None) is None:
            raise PrefillConfigError(f"{type(self).__name__}: the model has no attention layout (KV groups)")
        self._given_model = self.model
        self._pool_factory = kv_factory
        self._buffers: KVBuffers | None = None
        self.lanes.pool_factory = self._new_pool

    def _new_pool(self, model, num_blocks: int, _block_size: int) -> Any:
        if self._pool_factory is not None:
            return self._pool_factory(model, num_blocks, self._buffers)
        return model.new_kv_cache(num_blocks, buffers=self._buffers)

    # -- set-up ---------------------------------------------------------
    def allocate_kv_cache_per_layer(
        self, per_layer_specs: Sequence, *, layer_groups: Sequence[Sequence[int]] | None = None
    ) -> Any:
        """Builds the grouped pool from one ``(shape, dtype[, tensor index])`` per layer; returns it.

        The layers are regrouped as vLLM groups them (``vllm_layer_groups``
        over each layer's kind, window and spec block size) unless
        ``layer_groups`` (each group's layers, in vLLM's group order) says
        otherwise; the tensor indices, when every spec has one, place the
        layers in KV buffers (else vLLM's plan: ``KVBuffers.shared``). Bad
        specs, groups or indices are a ``PrefillConfigError`` naming them,
        before the previous pool is released.
        """
        num_blocks, block_sizes, indices = self._checked_specs(per_layer_specs)
        kinds = self._given_model.attention.layer_specs
        specs = [(kind, window, bs) for (kind, window, _), bs in zip(kinds, block_sizes)]
        groups = vllm_layer_groups(specs) if layer_groups is None else layer_groups
        try:
            layout = AttentionLayout.from_layer_groups(specs, groups)
            layout.check_fits(max(block_sizes))
        except InvalidLayoutError as error:
            what = "vLLM's grouping" if layer_groups is None else f"layer_groups={layer_groups!r}"
            raise PrefillConfigError(f"per_layer_specs under {what} are invalid: {error}") from None
        try:
            buffers = KVBuffers.shared(layout) if indices is None else KVBuffers(layout, indices)
        except InvalidLayoutError as error:
            raise PrefillConfigError(f"per_layer_specs' tensor indices {indices} are invalid: {error}") from None
        self._regrouped(layout)  # refused by name before the previous pool is released
        self._release()
        self.lanes.regroup(lambda lane_model: self._regrouped(layout, lane_model))
        self.model = self.lanes.model
        self._buffers = buffers
        try:
            self.kv = self.lanes.build(num_blocks, layout.groups[0].block_size, self._lane_executor)
        except BaseException as error:
            add_note(error, "allocate_kv_cache_per_layer released the previous pool: none is allocated now")
            raise
        return self.kv

    def allocate_kv_cache(self, kv_cache_shape=None, dtype=None, num_layers=None) -> Any:
        """The plugin's legacy call: one shape for every layer (every group at its block size)."""
        if kv_cache_shape is None and dtype is None and num_layers is None:
            return super().allocate_kv_cache()
        if kv_cache_shape is None or dtype is None or num_layers is None:
            raise TypeError("kv_cache_shape, dtype, and num_layers must be supplied together")
        if type(num_layers) is not int or num_layers < 0:
            raise PrefillConfigError(f"vLLM's KV num_layers={num_layers!r} is invalid: the model needs an int")
        return self.allocate_kv_cache_per_layer([(kv_cache_shape, dtype)] * num_layers)

    def _regrouped(self, layout: AttentionLayout, model=None):
        """``model`` (the facade's given one by default) with its layers in ``layout``'s groups."""
        model = self._given_model if model is None else model
        if layout == model.attention:
            return model
        regroup = getattr(model, "with_attention", None)
        if regroup is None:
            msg = (
                f"{type(model).__name__} has no with_attention: it cannot serve vLLM's KV groups "
                f"{layout.layer_groups} (its own are {model.attention.layer_groups})"
            )
            raise PrefillConfigError(msg)
        return regroup(layout)

    def _checked_specs(self, specs: Sequence) -> tuple[int, list[int], list[int] | None]:
        """``(num_blocks, each layer's block size, each layer's tensor index or None)``, each spec checked."""
        spec = self.model.spec
        if not isinstance(specs, (list, tuple)) or len(specs) != spec.num_layers:
            count = len(specs) if isinstance(specs, (list, tuple)) else type(specs).__name__
            raise PrefillConfigError(f"per_layer_specs={count} is invalid: the model needs {spec.num_layers} layers")
        heads = _kv_heads_per_device(spec.num_kv_heads, getattr(self.backend, "num_devices", 1))
        num_blocks, block_sizes, indices = None, [], []
        for layer, entry in enumerate(specs):
            ok = isinstance(entry, (list, tuple)) and len(entry) in (2, 3)
            shape = tuple(entry[0]) if ok and isinstance(entry[0], (list, tuple, torch.Size)) else ()
            dtype = entry[1] if ok else None
            if len(shape) != 4 or not all(type(d) is int and d > 0 for d in shape):
                rule = "must be (shape, dtype[, tensor index]) with a shape of 4 ints > 0"
                raise PrefillConfigError(f"per_layer_specs[{layer}]={entry!r} is invalid: {rule}")
            want = (shape[0] if num_blocks is None else num_blocks, heads, shape[2], spec.head_dim)
            if shape != want or dtype != self._kv_dtype:
                msg = (
                    f"per_layer_specs[{layer}]=({shape!r}, {dtype}) is invalid: every layer needs "
                    f"(num_blocks, kv_heads, block_size, head_dim) = {want} in {self._kv_dtype} "
                    "(one block-id space for all layers)"
                )
                raise PrefillConfigError(msg)
            num_blocks = shape[0]
            block_sizes.append(shape[2])
            indices.append(entry[2] if len(entry) == 3 else None)
        if all(i is None for i in indices):
            return num_blocks, block_sizes, None
        if any(i is None for i in indices):
            raise PrefillConfigError(f"per_layer_specs' tensor indices {indices} are invalid: give every layer one")
        return num_blocks, block_sizes, indices

    def _lane_executor(self, model, backend, kv, num_blocks: int, block_size: int, seed: int):
        # The layout's block size is the pool's planning block (the largest group's), whatever vLLM's first.
        return super()._lane_executor(model, backend, kv, num_blocks, kv.block_size, seed)

    # -- the call -------------------------------------------------------
    def _plan_keywords(self, kwargs: dict, page_table, prompt_lens, num_rows: int) -> dict:
        """Each group's table: ``page_tables_per_layer`` (a group's first layer's, the call's rows), or
        ``page_table`` where there is one group and no per-layer tables (the plugin sends none then)."""
        tables = kwargs.get("page_tables_per_layer")
        attention = self.model.attention
        null = {"null_block": VLLM_NULL_BLOCK}
        if tables is None and len(attention.groups) == 1:
            return {"group_page_tables": [page_table], **null}
        if not isinstance(tables, (list, tuple)) or len(tables) != attention.num_layers:
            got = type(tables).__name__ if not isinstance(tables, (list, tuple)) else f"{len(tables)} tables"
            msg = (
                f"page_tables_per_layer={got} is invalid: a model in {len(attention.groups)} KV groups needs one "
                f"table per layer ({attention.num_layers})"
            )
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
        return {"group_page_tables": groups, **null}


class HybridServingFacade(KVGroups, ServingFacade):
    """``ServingFacade`` over a model with ``attention`` (``prefill_core.AttentionLayout``): one lane, KV groups."""


class HybridLaneGroupFacade(KVGroups, LaneGroupFacade):
    """``LaneGroupFacade`` over a model with KV groups: one lane per data-parallel rank, every lane regrouped as
    vLLM groups the layers, each lane's pool in vLLM's buffers."""


def _rows(table, num_rows: int, layer: int) -> torch.Tensor:
    """The call's rows of one layer's table (the plugin pads short calls to ``max_num_seqs`` rows)."""
    table = _cast(table, torch.int32)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] < num_rows:
        msg = f"page_tables_per_layer[{layer}] is invalid: must be a 2-D integer tensor of at least {num_rows} rows"
        raise PrefillInputError(msg, field=f"page_tables_per_layer[{layer}]")
    return table[:num_rows]
