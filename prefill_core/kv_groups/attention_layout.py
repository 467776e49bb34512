"""A model's attention layout as a value: its layers in KV groups, each with one page table.

Theory of operation
-------------------
A hybrid model (Gemma 2/3, GPT-OSS, Qwen3 with ``layer_types``, Mistral with
``sliding_window``) mixes sliding-window and full-attention layers. A serving
engine keeps its layers in KV cache *groups* (vLLM's hybrid KV cache
manager: ``kv_cache_groups``), each with its own block table and, since vLLM
equalises page size rather than block size, its own block size; every group
draws block ids from one shared pool. vLLM forms groups of an equal number
of layers, several per attention type where one type has more layers
(``kv_grouping.py``; ``vllm_grouped`` builds that layout); ``from_layer_types``
keeps one group per attention type, the fewest tables for a caller that is
free to choose.

1. A ``KVGroup`` is an attention kind, a window (sliding only: a query at
   position q sees keys k with ``q - window < k <= q``, transformers' and
   vLLM's rule), a block size and the decoder layers it serves. Groups of
   one kind and window may repeat (vLLM keeps equal-sized groups, so two
   sliding layers and one full layer are three groups of one layer each).
2. Every layer is in exactly one group. Groups are numbered as the caller
   numbers them (vLLM's order, which need not follow the first layers:
   ``kv_grouping.py``); group 0's table is the plugin's ``page_table``.
3. Every group's block size divides the planning block size (chunk starts
   are multiples of it, hence block-aligned in every group).

What a step reads and writes per group is ``windows.py``; the per-group
tables of a call are ``group_tables.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from prefill_core.kv_groups.kv_grouping import vllm_layer_groups
from prefill_core.values.errors import InvalidLayoutError, field_error

__all__ = ["AttentionKind", "KVGroup", "AttentionLayout"]


class AttentionKind(enum.Enum):
    """What a layer's queries see: every earlier key, or a sliding window of them.

    The values are transformers' ``layer_types`` strings.
    """

    FULL = "full_attention"
    SLIDING = "sliding_attention"


def _check_group(group: KVGroup) -> None:
    owner = "KVGroup"
    sliding = group.kind is AttentionKind.SLIDING
    if not isinstance(group.kind, AttentionKind):
        raise field_error(InvalidLayoutError, owner, "kind", group.kind, "must be an AttentionKind")
    if sliding and (type(group.window) is not int or group.window < 1):
        raise field_error(InvalidLayoutError, owner, "window", group.window, "a sliding group needs an int >= 1")
    if not sliding and group.window is not None:
        raise field_error(InvalidLayoutError, owner, "window", group.window, "a full-attention group has none")
    bs = group.block_size
    if type(bs) is not int or bs < 1 or bs & (bs - 1):
        raise field_error(InvalidLayoutError, owner, "block_size", bs, "must be a positive power of two")
    layers = group.layers
    if type(layers) is not tuple or not layers or any(type(x) is not int or x < 0 for x in layers):
        raise field_error(InvalidLayoutError, owner, "layers", layers, "must be a non-empty tuple of ints >= 0")
    if list(layers) != sorted(set(layers)):
        raise field_error(InvalidLayoutError, owner, "layers", layers, "must be increasing, each layer once")


@attrs.frozen
class KVGroup:
    """Layers that share one page table: their kind, window (sliding only) and block size."""

    kind: AttentionKind
    window: int | None
    block_size: int
    layers: tuple[int, ...]

    def __attrs_post_init__(self):
        _check_group(self)

    @property
    def is_sliding(self) -> bool:
        return self.kind is AttentionKind.SLIDING


def _check_layout(layout: AttentionLayout) -> None:
    groups = layout.groups
    if type(groups) is not tuple or not groups or not all(isinstance(g, KVGroup) for g in groups):
        raise field_error(InvalidLayoutError, "AttentionLayout", "groups", groups, "must be a tuple of KVGroups")
    layers = sorted(x for g in groups for x in g.layers)
    if layers != list(range(len(layers))):
        rule = "every layer 0..n-1 must be in exactly one group"
        raise field_error(InvalidLayoutError, "AttentionLayout", "groups", [g.layers for g in groups], rule)


@attrs.frozen(cache_hash=True)
class AttentionLayout:
    """Every decoder layer of a model, in KV groups (see the module's rules)."""

    groups: tuple[KVGroup, ...]

    def __attrs_post_init__(self):
        _check_layout(self)

    @classmethod
    def full(cls, num_layers: int, block_size: int) -> AttentionLayout:
        """A model whose every layer attends to every earlier key: one group."""
        return cls((KVGroup(AttentionKind.FULL, None, block_size, tuple(range(num_layers))),))

    @classmethod
    def from_layer_types(
        cls,
        layer_types: Sequence[str],
        *,
        sliding_window: int | None,
        block_size: int,
        sliding_block_size: int | None = None,
    ) -> AttentionLayout:
        """One group per attention kind, as a model config names its layers, in order of first appearance.

        ``layer_types`` are transformers' strings (``"full_attention"``,
        ``"sliding_attention"``); ``sliding_block_size`` (default
        ``block_size``) is the sliding groups' block size.
        """
        specs = _layer_specs(layer_types, sliding_window, block_size, sliding_block_size)
        order = list(dict.fromkeys(specs))
        return cls.from_layer_groups(specs, [[i for i, s in enumerate(specs) if s == o] for o in order])

    @classmethod
    def from_layer_groups(
        cls, layer_specs: Sequence[tuple[AttentionKind, int | None, int]], groups: Sequence[Sequence[int]]
    ) -> AttentionLayout:
        """The layout with these groups (layer indices, in the caller's group order) over layers of these specs.

        ``layer_specs[i]`` is layer i's ``(kind, window, block_size)``; the
        layers of a group must share one (``InvalidLayoutError`` naming the group).
        """
        built = []
        for index, layers in enumerate(groups):
            layers = tuple(sorted(layers))
            if not layers or any(type(x) is not int or not 0 <= x < len(layer_specs) for x in layers):
                rule = f"must be a non-empty list of layer indices in [0, {len(layer_specs)})"
                raise field_error(InvalidLayoutError, f"AttentionLayout.groups[{index}]", "layers", layers, rule)
            specs = {layer_specs[x] for x in layers}
            if len(specs) != 1:
                rule = "a group's layers share one kind, window and block size"
                shown = {x: layer_specs[x] for x in layers}
                raise field_error(InvalidLayoutError, f"AttentionLayout.groups[{index}]", "layers", shown, rule)
            kind, window, block_size = specs.pop()
            built.append(KVGroup(kind, window, block_size, layers))
        if sorted(x for g in built for x in g.layers) != list(range(len(layer_specs))):
            rule = f"every layer 0..{len(layer_specs) - 1} must be in exactly one group"
            raise field_error(InvalidLayoutError, "AttentionLayout", "groups", [g.layers for g in built], rule)
        return cls(tuple(built))

    def regrouped(self, groups: Sequence[Sequence[int]]) -> AttentionLayout:
        """The same layers (kinds, windows, block sizes) in these groups (``from_layer_groups``)."""
        return type(self).from_layer_groups(self.layer_specs, groups)

    def vllm_grouped(self) -> AttentionLayout:
        """The same layers in the groups vLLM's hybrid KV cache manager forms (``kv_grouping.vllm_layer_groups``):
        several groups may share a kind and window."""
        return self.regrouped(vllm_layer_groups(self.layer_specs))

    @property
    def layer_specs(self) -> tuple[tuple[AttentionKind, int | None, int], ...]:
        """Each layer's ``(kind, window, block_size)``, in layer order."""
        specs: dict[int, tuple[AttentionKind, int | None, int]] = {}
        for group in self.groups:
            specs.update(dict.fromkeys(group.layers, (group.kind, group.window, group.block_size)))
        return tuple(specs[layer] for layer in range(self.num_layers))

    @property
    def layer_groups(self) -> tuple[tuple[int, ...], ...]:
        """Each group's layers, in group order."""
        return tuple(g.layers for g in self.groups)

    def position_in_group(self, layer: int) -> int:
        """Where ``layer`` stands among its group's layers (vLLM's KV tensor index of a layer)."""
        return self.groups[self.group_of(layer)].layers.index(layer)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether any group slides (then tables differ per group and windows bound every read)."""
        return any(g.is_sliding for g in self.groups)

    def group_of(self, layer: int) -> int:
        """The group serving ``layer``."""
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return index
        raise IndexError(f"layer {layer} of a {self.num_layers}-layer attention layout")

    def check_fits(self, planning_block_size: int) -> None:
        """Raises ``InvalidLayoutError`` unless every group's block size divides the planning block size."""
        for index, group in enumerate(self.groups):
            if planning_block_size % group.block_size:
                rule = (
                    f"must divide the page-table layout's block_size={planning_block_size} (chunk starts align to it)"
                )
                raise field_error(
                    InvalidLayoutError, f"AttentionLayout.groups[{index}]", "block_size", group.block_size, rule
                )


def _layer_specs(
    layer_types: Sequence[str], sliding_window: int | None, block_size: int, sliding_block_size: int | None
) -> list[tuple[AttentionKind, int | None, int]]:
    """Each layer's ``(kind, window, block_size)`` from transformers' ``layer_types`` strings."""
    try:
        kinds = [AttentionKind(t) for t in layer_types]
    except ValueError:
        names = [k.value for k in AttentionKind]
        raise field_error(
            InvalidLayoutError, "AttentionLayout", "layer_types", list(layer_types), f"each must be one of {names}"
        ) from None
    sliding = (AttentionKind.SLIDING, sliding_window, sliding_block_size or block_size)
    full = (AttentionKind.FULL, None, block_size)
    return [sliding if kind is AttentionKind.SLIDING else full for kind in kinds]
