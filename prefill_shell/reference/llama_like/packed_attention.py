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

Cached segments that lie back to back, start at the same position and
read the same prefix blocks (rows behind one shared system prompt) run as
one masked call on the CPU:
their queries and fresh keys padded to the longest of them, the prefix
gathered once and shared, one causal mask for all (a padded key is visible
only to padded queries, whose outputs are dropped). Only short segments
group (at most ``SHARED_PREFIX_LENGTH`` tokens: chat turns behind a system
prompt), where a call's fixed cost is most of it; longer ones (a reranker's
documents) computed more for the padding than the joint call saved
(``benchmarks/host_forms.py``, ``shared_prefix_*``). And a group is formed
only while its padding stays within ``SHARED_PREFIX_PADDING`` of its real
tokens, so one longer segment does not make many short ones compute at its
length.

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
    "end_segments",
    "PackedWrites",
    "SHARED_PREFIX_LENGTH",
    "SHARED_PREFIX_PADDING",
    "SegmentRead",
    "StepReads",
    "packed_writes",
    "prefix_then_causal",
    "segment_attention",
    "segment_reads",
    "shared_packed_writes",
    "write_packed",
]


ONE_CALL_KEYS = 512
"""On the CPU, a cached segment reading at most this many keys (prefix and its own) runs as one masked call."""

SHARED_PREFIX_LENGTH = 64
"""The longest cached segment that joins a shared-prefix group."""

SHARED_PREFIX_PADDING = 1.5
"""The most padded query tokens a shared-prefix group computes per real one (``SegmentRead.padded``)."""


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
    # A shared-prefix group of ``rows`` cached segments of up to ``length`` tokens: (the step's token
    # index of each padded position [rows * length], the padded positions holding real tokens [span]).
    padded: tuple[torch.Tensor, torch.Tensor] | None = None
    span: int = 0  # a group's real tokens (its segments' lengths summed)

    @property
    def end(self) -> int:
        """The token offset just past these segments."""
        return self.offset + (self.span if self.padded is not None else self.rows * self.length)


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
    shared: list[tuple[int, int]] = []  # (offset, length) of the open shared-prefix group's segments
    shared_blocks: torch.Tensor | None = None

    def close_group() -> None:  # the open group's read, built once when no further segment joins
        if len(shared) > 1:
            reads[-1] = _shared_group(reads[-1], shared, dtype, segments.device)
        shared.clear()

    for i, (offset, length, start) in enumerate(segments.tolist()):
        if start == 0:
            close_group()
            last = reads[-1] if reads else None
            if last is not None and last.start == 0 and (last.length, last.end) == (length, offset):
                reads[-1] = last._replace(rows=last.rows + 1)
            else:
                reads.append(SegmentRead(offset, length, 1, 0, 0, None))
            continue
        width = ceil_div(start, block_size)
        row_blocks = prefix_table[i, :width]
        if cpu and _joins(reads[-1] if reads else None, shared, shared_blocks, offset, length, start, row_blocks):
            shared.append((offset, length))
            continue
        close_group()
        blocks.append(row_blocks)
        shared.append((offset, length))
        shared_blocks = row_blocks
        mask = None
        if not cpu or start + length <= ONE_CALL_KEYS:
            mask = _causal_after(start, length, dtype, segments.device)
        reads.append(SegmentRead(offset, length, 1, start, prefix_at, mask))
        prefix_at += width * block_size
    close_group()
    return StepReads(reads, torch.cat(blocks)[None].to(torch.int64) if blocks else None)


def _causal_after(start: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[length, start + length]`` additive: 0 where key j <= start + i, -inf past it."""
    return torch.full((length, start + length), float("-inf"), dtype=dtype, device=device).triu_(diagonal=start + 1)


def _joins(last, shared, shared_blocks, offset: int, length: int, start: int, row_blocks: torch.Tensor) -> bool:
    """Whether a cached segment joins the open shared-prefix group (``shared``, whose first read is ``last``):
    it follows the group's last segment, starts where they start, reads the same blocks, the joint call stays
    one masked call, and the padding bound holds."""
    if last is None or not shared or last.start != start or last.mask is None or sum(shared[-1]) != offset:
        return False
    if shared_blocks is None or not torch.equal(shared_blocks, row_blocks):
        return False
    longest = max(length, *(n for _, n in shared))
    real = length + sum(n for _, n in shared)
    return (
        longest <= SHARED_PREFIX_LENGTH
        and start + longest <= ONE_CALL_KEYS
        and (len(shared) + 1) * longest <= SHARED_PREFIX_PADDING * real
    )


def _shared_group(first: SegmentRead, shared: list[tuple[int, int]], dtype, device) -> SegmentRead:
    """One read for the group's segments: padded token indices, kept positions, one mask at the longest."""
    longest = max(n for _, n in shared)
    gather, keep = [], []
    for r, (offset, length) in enumerate(shared):
        # A padded position repeats the row's last token: finite, and seen only by padded queries.
        gather += [offset + min(i, length - 1) for i in range(longest)]
        keep += range(r * longest, r * longest + length)
    padded = (torch.tensor(gather, device=device), torch.tensor(keep, device=device))
    mask = _causal_after(first.start, longest, dtype, device)
    span = sum(n for _, n in shared)
    return first._replace(length=longest, rows=len(shared), mask=mask, padded=padded, span=span)


def packed_writes(write_slots: torch.Tensor, block_size: int) -> PackedWrites:
    """The tokens whose slot is not -1, with the block and in-block offset each one writes."""
    if bool((write_slots >= 0).all()):
        return PackedWrites(None, write_slots // block_size, write_slots % block_size)
    tokens = torch.nonzero(write_slots >= 0).flatten()
    slots = write_slots[tokens]
    return PackedWrites(tokens, slots // block_size, slots % block_size)


def shared_packed_writes(pairs: torch.Tensor, block_size: int) -> PackedWrites:
    """A step's shared writes (``[N, 2]`` token, slot: ``contract.PACKED_SHARED_WRITES``) as ``PackedWrites``."""
    tokens, slots = pairs[:, 0].contiguous(), pairs[:, 1]
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
        if read.padded is not None:  # a shared-prefix group: padded rows, then the real positions kept
            gather, keep = read.padded
            q_s, k_s, v_s = (
                x.index_select(0, gather).unflatten(0, (read.rows, read.length)).transpose(1, 2) for x in (q, k, v)
            )
            cut = slice(read.prefix_at, read.prefix_at + read.start)
            old_k, old_v = (p[:, :, cut].to(k.dtype).expand(read.rows, -1, -1, -1) for p in (prefix_k, prefix_v))
            keys, values = torch.cat((old_k, k_s), dim=2), torch.cat((old_v, v_s), dim=2)
            out = sdpa(q_s, keys, values, attn_mask=read.mask)
            outputs.append(out.transpose(1, 2).flatten(0, 1).index_select(0, keep))
            continue
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


def end_segments(
    segments: torch.Tensor, prefix_table: torch.Tensor, write_slots: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each segment's last token as a segment of its own, once the step's K/V are in the pool.

    Returns ``(segments, prefix_table)`` of a step whose token ``g`` is segment ``g``'s last token: offset
    ``g``, length 1, start ``start + length - 1``, reading every earlier position of its row from the pool: the
    blocks of its prefix table before ``start``, then the blocks this step writes for it (``write_slots``). Valid
    only after every token's K/V of the layer is written (``PACKED_CAPABILITY``'s order) and for a segment
    that writes its positions (one that does not is a re-run of length 1, whose prefix is all of it).
    """
    rows = segments.tolist()
    slots = write_slots.tolist()
    tables = []
    for g, (offset, length, start) in enumerate(rows):
        blocks = prefix_table[g, : ceil_div(start, block_size)].tolist()
        for position in range(ceil_div(start, block_size) * block_size, start + length - 1, block_size):
            blocks.append(slots[offset + position - start] // block_size)  # this step's block of that position
        tables.append(blocks)
    width = max(1, max(len(t) for t in tables))
    table = torch.zeros(len(rows), width, dtype=prefix_table.dtype)
    for g, blocks in enumerate(tables):
        table[g, : len(blocks)] = torch.tensor(blocks, dtype=prefix_table.dtype)
    ends = torch.tensor([(g, 1, start + length - 1) for g, (_, length, start) in enumerate(rows)], dtype=torch.int64)
    return ends, table
