"""Attention and KV writes of a packed step (``prefill_core.packed``): per-segment causal attention.

A packed step's tokens are row segments laid end to end. Each segment's
queries attend to its row's positions before ``start``, gathered from the
pool through the segment's own prefix table and cut at exactly ``start``
(nothing at or past it, no filler column, is ever gathered), followed by the
segment's own fresh K/V under a causal mask. K/V are written token by token
into the slots the step names (``block * bs + position % bs``): a segment
may start at any position, and a fully cached row's re-run (slots ``-1``)
writes nothing. Eager only: the shapes follow each step's segments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from prefill_core import ceil_div
from prefill_shell.reference.kv_cache import PagedKVCache

__all__ = ["PackedWrites", "SegmentRead", "packed_writes", "segment_attention", "segment_reads", "write_packed"]


class SegmentRead(NamedTuple):
    """What one segment's queries read, decided once per step."""

    offset: int
    length: int
    start: int
    prefix_blocks: torch.Tensor | None  # [1, ceil(start / bs)] block ids; None when start is 0
    mask: torch.Tensor | None  # [length, start + length] bool, key j visible to query i iff j <= start + i


class PackedWrites(NamedTuple):
    """The step's tokens that write, and where: ``tokens`` into ``blocks`` at ``offsets``."""

    tokens: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor


def segment_reads(segments: torch.Tensor, prefix_table: torch.Tensor, block_size: int) -> list[SegmentRead]:
    """One ``SegmentRead`` per row of the ``[G, 3]`` segment table (one host read of the table)."""
    reads = []
    for i, (offset, length, start) in enumerate(segments.tolist()):
        if start == 0:
            reads.append(SegmentRead(offset, length, 0, None, None))
            continue
        blocks = prefix_table[i : i + 1, : ceil_div(start, block_size)].to(torch.int64)
        mask = torch.ones(length, start + length, dtype=torch.bool, device=segments.device).tril(diagonal=start)
        reads.append(SegmentRead(offset, length, start, blocks, mask))
    return reads


def packed_writes(write_slots: torch.Tensor, block_size: int) -> PackedWrites:
    """The tokens whose slot is not -1, with the block and in-block offset each one writes."""
    tokens = torch.nonzero(write_slots >= 0).flatten()
    slots = write_slots[tokens]
    return PackedWrites(tokens, slots // block_size, slots % block_size)


def write_packed(kv: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, writes: PackedWrites) -> None:
    """Writes fresh ``k, v [1, Hkv, T, D]`` of the writing tokens into their slots of ``layer``."""
    if writes.tokens.numel() == 0:
        return
    kv.keys[layer][writes.blocks, :, writes.offsets] = k[0, :, writes.tokens].transpose(0, 1).to(kv.dtype)
    kv.values[layer][writes.blocks, :, writes.offsets] = v[0, :, writes.tokens].transpose(0, 1).to(kv.dtype)


def segment_attention(
    kv: PagedKVCache,
    layer: int,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    reads: list[SegmentRead],
    sdpa: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``[1, H, T, D]``: each segment's queries over its row's prefix and its own causal keys."""
    q, k, v = qkv
    outputs = []
    for read in reads:
        span = slice(read.offset, read.offset + read.length)
        q_s, k_s, v_s = q[:, :, span], k[:, :, span], v[:, :, span]
        if read.prefix_blocks is None:
            outputs.append(sdpa(q_s, k_s, v_s, is_causal=True))
            continue
        old_k, old_v = kv.gather(layer, read.prefix_blocks)  # [1, Hkv, ceil(start / bs) * bs, D]
        k_all = torch.cat((old_k[:, :, : read.start].to(k.dtype), k_s), dim=2)
        v_all = torch.cat((old_v[:, :, : read.start].to(v.dtype), v_s), dim=2)
        outputs.append(sdpa(q_s, k_all, v_all, attn_mask=read.mask))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
