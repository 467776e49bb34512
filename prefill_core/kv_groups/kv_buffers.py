"""Which KV buffer holds each layer's pages: vLLM's shared KV tensors as a value.

vLLM sizes the KV cache for tensors shared across KV groups, not one pool per
group: with groups of an equal number of layers (``kv_grouping.py``), KV
tensor i holds the i-th layer of *every* group, and block ids are disjoint
between groups, so block b of tensor i is the page of whichever group owns b.
The plugin hands each layer's tensor index over with its spec
(``allocate_kv_cache_per_layer``). ``KVBuffers`` is that assignment; a pool
allocates one K and one V buffer per index, ``num_blocks`` deep, which is
exactly the memory vLLM planned.

Invariants (``InvalidLayoutError`` naming the layer, its index and the rule):

1. one index per layer of the layout, the indices used being ``0..n-1``;
2. layers sharing a buffer are in distinct groups (two layers of one group
   would write one block's page each over the other's);
3. layers sharing a buffer share a block size (one page shape per buffer).

Sharing is safe because of the one-block-id-space rule the group tables
already enforce (``group_rules``: a block kept in two groups is refused
before anything is written).
"""

from __future__ import annotations

import attrs

from prefill_core.kv_groups.attention_layout import AttentionLayout
from prefill_core.values.errors import InvalidLayoutError, field_error

__all__ = ["KVBuffers"]


def _check(buffers: KVBuffers) -> None:
    attention, buffer_of = buffers.attention, buffers.buffer_of
    if len(buffer_of) != attention.num_layers:
        rule = f"one buffer index per layer ({attention.num_layers})"
        raise field_error(InvalidLayoutError, "KVBuffers", "buffer_of", buffer_of, rule)
    for layer, index in enumerate(buffer_of):
        if type(index) is not int or index < 0:
            raise field_error(InvalidLayoutError, "KVBuffers", f"buffer_of[{layer}]", index, "must be an int >= 0")
    used = sorted(set(buffer_of))
    if used != list(range(len(used))):
        rule = f"the indices used must be 0..n-1 (vLLM's KV tensor indices); used {used}"
        raise field_error(InvalidLayoutError, "KVBuffers", "buffer_of", buffer_of, rule)
    holder: dict[int, int] = {}
    for layer, index in enumerate(buffer_of):
        other = holder.setdefault(index, layer)
        if other == layer:
            continue
        g, h = attention.group_of(layer), attention.group_of(other)
        if g == h:
            rule = f"layer {other} is in buffer {index} too, both in KV group {g}: a group's layers need a buffer each"
            raise field_error(InvalidLayoutError, "KVBuffers", f"buffer_of[{layer}]", index, rule)
        sizes = attention.groups[g].block_size, attention.groups[h].block_size
        if sizes[0] != sizes[1]:
            rule = (
                f"layer {other} (KV group {h}, block size {sizes[1]}) is in buffer {index} too: layers sharing a "
                f"buffer share a block size, not {sizes[0]}"
            )
            raise field_error(InvalidLayoutError, "KVBuffers", f"buffer_of[{layer}]", index, rule)


@attrs.frozen(cache_hash=True)
class KVBuffers:
    """``buffer_of[layer]``: the KV buffer (vLLM's KV tensor index) holding ``layer``'s pages under ``attention``."""

    attention: AttentionLayout
    buffer_of: tuple[int, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        _check(self)

    @classmethod
    def shared(cls, attention: AttentionLayout) -> KVBuffers:
        """vLLM's plan: a layer's buffer is its position in its group, where every group has one block size.

        Groups of different block sizes have different page shapes, which vLLM
        never puts in one tensor: then each layer has a buffer of its own.
        """
        if len({g.block_size for g in attention.groups}) == 1:
            return cls(attention, tuple(attention.position_in_group(i) for i in range(attention.num_layers)))
        return cls(attention, tuple(range(attention.num_layers)))

    @classmethod
    def per_layer(cls, attention: AttentionLayout) -> KVBuffers:
        """A buffer per layer, as a plain model's pool has: no two groups share a page, so each group's block
        ids are its own and one page table can serve every group."""
        return cls(attention, tuple(range(attention.num_layers)))

    @property
    def shares_pages(self) -> bool:
        """Whether two groups' layers hold their pages in one buffer (then block ids are one space)."""
        return self.num_buffers < self.attention.num_layers

    @property
    def num_buffers(self) -> int:
        return len(set(self.buffer_of))

    def layers_of(self, buffer: int) -> tuple[int, ...]:
        """The layers whose pages ``buffer`` holds, in layer order."""
        return tuple(layer for layer, index in enumerate(self.buffer_of) if index == buffer)

    def block_size_of(self, buffer: int) -> int:
        """The block size of ``buffer``'s pages (its layers' groups')."""
        return self.attention.groups[self.attention.group_of(self.layers_of(buffer)[0])].block_size
