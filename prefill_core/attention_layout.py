"""A model's attention layout as a value: its layers in KV groups, each with one page table.

Theory of operation
-------------------
A hybrid model (Gemma 2/3, GPT-OSS, Qwen3 with ``layer_types``, Mistral with
``sliding_window``) mixes sliding-window and full-attention layers. A serving
engine keeps one KV cache *group* per attention type (vLLM's hybrid KV cache
manager: ``kv_cache_groups``), each with its own block table and, since vLLM
equalises page size rather than block size, its own block size; every group
draws block ids from one shared pool.

1. A ``KVGroup`` is an attention kind, a window (sliding only: a query at
   position q sees keys k with ``q - window < k <= q``, transformers' and
   vLLM's rule), a block size and the decoder layers it serves. Groups of
   one kind and window may repeat (vLLM keeps equal-sized groups, so two
   sliding layers and one full layer are three groups of one layer each).
2. Every layer is in exactly one group; groups are numbered as vLLM numbers
   them, in order of their first layer, so group 0's table is the plugin's
   plain ``page_table`` argument.
3. Every group's block size divides the planning block size (chunk starts
   are multiples of it, hence block-aligned in every group).

What a step reads and writes per group is ``windows.py``; the per-group
tables of a call are ``group_tables.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from .errors import InvalidLayoutError, field_error

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
    firsts = [g.layers[0] for g in groups]
    if firsts != sorted(firsts):
        rule = "groups are numbered in order of their first layer (vLLM's numbering: group 0 is page_table's)"
        raise field_error(InvalidLayoutError, "AttentionLayout", "groups", firsts, rule)


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
        """One group per attention kind, as a model config names its layers.

        ``layer_types`` are transformers' strings (``"full_attention"``,
        ``"sliding_attention"``); ``sliding_block_size`` (default
        ``block_size``) is the sliding group's block size.
        """
        try:
            kinds = [AttentionKind(t) for t in layer_types]
        except ValueError:
            names = [k.value for k in AttentionKind]
            raise field_error(
                InvalidLayoutError, "AttentionLayout", "layer_types", list(layer_types), f"each must be one of {names}"
            ) from None
        order: list[AttentionKind] = []
        for kind in kinds:
            if kind not in order:
                order.append(kind)
        groups = []
        for kind in order:
            sliding = kind is AttentionKind.SLIDING
            layers = tuple(i for i, k in enumerate(kinds) if k is kind)
            bs = (sliding_block_size or block_size) if sliding else block_size
            groups.append(KVGroup(kind, sliding_window if sliding else None, bs, layers))
        return cls(tuple(groups))

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
