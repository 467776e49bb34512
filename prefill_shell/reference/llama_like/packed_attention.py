"""Attention and KV writes of a packed step (``prefill_core.planning.packed``): per-segment causal attention.

A packed step's tokens are row segments laid end to end. Each segment's
queries attend to its row's positions before ``start``, gathered from the
pool through the segment's own prefix table (one gather per layer covers
every segment's prefix blocks) and cut at exactly ``start`` (no filler
column is gathered, and no position at or past ``start`` meets a query),
followed by the segment's own fresh K/V under a causal mask. K/V are
written token by token into the slots the step names (``block * bs +
position % bs``): a segment may start at any position, and a fully cached
row's re-run (slots ``-1``) writes nothing. Eager only: the shapes follow
each step's segments.

Tensors here are token-major, ``[T, heads, D]``, as the QKV projection lays
them out, so the attention output feeds ``o_proj`` without a transpose copy.
Equal-length uncached segments that lie back to back (a batch of same-length
prompts) run as one batched attention call rather than one call each.

A cached segment's attention is one call over ``[prefix | own]`` keys
under a causal mask, except on the CPU when the segment reads more than
``ONE_CALL_KEYS`` keys: there it is two flash-attention calls, one over its
prefix (every key visible) and one causal over its own keys, merged by their
log-sum-exps (``prefix_then_causal``), the same softmax without copying a
long prefix beside the fresh keys, and the causal half skips the key blocks
past each query. A scorer's short continuations over short contexts are the
other way round: there the two calls and the merge cost more than the copy
and the mask (``benchmarks/host_forms.py``, rows ``cached_attention_*``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from prefill_core import ceil_div
from prefill_shell.reference.pools.kv_cache import PagedKVCache

__all__ = [
    "ONE_CALL_KEYS",
    "PackedWrites",
    "SegmentRead",
    "StepReads",
    "packed_writes",
    "prefix_then_causal",
    "segment_attention",
    "segment_reads",
    "write_packed",
]


ONE_CALL_KEYS = 512
"""On the CPU, a cached segment reading at most this many keys (prefix and its own) runs as one masked call."""


class SegmentRead(NamedTuple):
    """What the queries of ``rows`` back-to-back segments of ``length`` tokens read.

    ``rows > 1`` only for uncached segments (``start`` 0), each causal over its own tokens.
    """

    offset: int
    length: int
    rows: int
    start: int
    prefix_at: int  # where its prefix begins among the step's gathered prefix positions
    # [length, start + length] additive: key j visible to query i iff j <= start + i. None where no
    # mask is needed: an uncached segment, or a long cached one on the CPU (``prefix_then_causal``).
    mask: torch.Tensor | None

    @property
    def end(self) -> int:
        """The token offset just past these segments."""
        return self.offset + self.rows * self.length


class StepReads(NamedTuple):
    """A step's reads, decided once per step: one pool gather per layer covers every segment's prefix."""

    segments: list[SegmentRead]
    prefix_blocks: torch.Tensor | None  # [1, P] each cached segment's prefix blocks, end to end; None: none cached


class PackedWrites(NamedTuple):
    """The step's tokens that write, and where: ``tokens`` (None: every token) into ``blocks`` at ``offsets``."""

    tokens: torch.Tensor | None
    blocks: torch.Tensor
    offsets: torch.Tensor


def segment_reads(segments: torch.Tensor, prefix_table: torch.Tensor, block_size: int, dtype: torch.dtype) -> StepReads:
    """The step's reads from its ``[G, 3]`` segment table (one host read of the table).

    Masks are built here once, in the model dtype, rather than per layer:
    attention would otherwise turn a boolean mask into an additive one on
    every call.
    """
    reads: list[SegmentRead] = []
    blocks: list[torch.Tensor] = []
    prefix_at = 0
    cpu = segments.device.type == "cpu"
    for i, (offset, length, start) in enumerate(segments.tolist()):
        if start == 0:
            last = reads[-1] if reads else None
            if last is not None and last.start == 0 and (last.length, last.end) == (length, offset):
                reads[-1] = last._replace(rows=last.rows + 1)
            else:
                reads.append(SegmentRead(offset, length, 1, 0, 0, None))
            continue
        width = ceil_div(start, block_size)
        blocks.append(prefix_table[i, :width])
        mask = None
        if not cpu or start + length <= ONE_CALL_KEYS:
            mask = torch.full((length, start + length), float("-inf"), dtype=dtype, device=segments.device)
            mask.triu_(diagonal=start + 1)  # 0 where key j <= start + i, -inf past it
        reads.append(SegmentRead(offset, length, 1, start, prefix_at, mask))
        prefix_at += width * block_size
    return StepReads(reads, torch.cat(blocks)[None].to(torch.int64) if blocks else None)


def packed_writes(write_slots: torch.Tensor, block_size: int) -> PackedWrites:
    """The tokens whose slot is not -1, with the block and in-block offset each one writes."""
    if bool((write_slots >= 0).all()):
        return PackedWrites(None, write_slots // block_size, write_slots % block_size)
    tokens = torch.nonzero(write_slots >= 0).flatten()
    slots = write_slots[tokens]
    return PackedWrites(tokens, slots // block_size, slots % block_size)


def write_packed(kv: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, writes: PackedWrites) -> None:
    """Writes fresh ``k, v [T, Hkv, D]`` of the writing tokens into their slots of ``layer``."""
    if writes.tokens is not None:
        if writes.tokens.numel() == 0:
            return
        k, v = k[writes.tokens], v[writes.tokens]
    kv.keys[layer][writes.blocks, :, writes.offsets] = k.to(kv.dtype)
    kv.values[layer][writes.blocks, :, writes.offsets] = v.to(kv.dtype)


def segment_attention(
    kv: PagedKVCache,
    layer: int,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    reads: StepReads,
    sdpa: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``[T, H, D]`` from token-major ``q [T, H, D]``, ``k, v [T, Hkv, D]``: each segment's
    queries over its row's prefix and its own causal keys."""
    q, k, v = qkv
    if reads.prefix_blocks is not None:
        prefix_k, prefix_v = kv.gather(layer, reads.prefix_blocks)  # [1, Hkv, P * bs, D]
    outputs = []
    for read in reads.segments:
        span = slice(read.offset, read.end)
        # [rows, heads, length, D] views of the segments' tokens
        q_s, k_s, v_s = (x[span].unflatten(0, (read.rows, read.length)).transpose(1, 2) for x in (q, k, v))
        if read.start == 0:
            out = sdpa(q_s, k_s, v_s, is_causal=True)
        else:
            cut = slice(read.prefix_at, read.prefix_at + read.start)
            old_k, old_v = prefix_k[:, :, cut].to(k.dtype), prefix_v[:, :, cut].to(v.dtype)
            if read.mask is None:
                out = prefix_then_causal(q_s, (old_k, old_v), (k_s, v_s))
            else:
                out = sdpa(q_s, torch.cat((old_k, k_s), dim=2), torch.cat((old_v, v_s), dim=2), attn_mask=read.mask)
        outputs.append(out.transpose(1, 2).flatten(0, 1))  # [rows * length, H, D]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def prefix_then_causal(
    q: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor], own: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Attention of ``q [1, H, S, D]`` over a prefix's keys (all visible) then its own (causal), on the CPU.

    Each flash call returns its output and its rows' log-sum-exp of scores;
    a part's share of the joint softmax is ``exp(lse_part - lse_joint)``.
    The CPU flash kernel reads grouped K/V heads itself.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    over_prefix, lse_prefix = flash(q, *prefix)
    over_own, lse_own = flash(q, *own, is_causal=True)
    joint = torch.logaddexp(lse_prefix, lse_own)
    merged = over_prefix * (lse_prefix - joint).exp_()[..., None] + over_own * (lse_own - joint).exp_()[..., None]
    return merged.to(q.dtype)
