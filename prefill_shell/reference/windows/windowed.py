"""Hybrid models on the reference decoders: KV buffers shared by the groups, windowed attention in padded steps.

A hybrid model's layers fall into KV groups (``prefill_core.AttentionLayout``),
each with its own block size and page table, all drawing block ids from one
space. ``GroupedKVCache`` holds the KV buffers the groups share as vLLM
plans them (KV tensor i holds layer i of every group,
``prefill_core.KVBuffers``); ``forward_grouped`` runs one padded step of the
model with each layer reading and writing through its group's tables
(``prefill_core.GroupedRequest.step_tables``).

What a windowed layer reads: the queries of ``[start, start + S)`` see keys
``k`` with ``q - window < k <= q`` (transformers' rule). The pool is gathered
only at the columns ``prefill_core.kv_groups.windows.read_columns`` names (the window,
clipped at the row's floor ``read_from``), which the core guarantees map the
row's real blocks; positions gathered there that lie before
``window_floor(start)`` or at or past ``start`` are zeroed, not only masked
(a masked NaN is still NaN). A first step starting inside a cached block
takes the K/V of its ``reused`` positions from the pool, so the block is
rewritten with its own bytes. Every other table entry, whatever it holds
(the null block, a stale id of a block another request now owns), is never
read, and only the fill table's blocks are written.

Eager only: the gather width follows the host value of ``start``, so this
step is not capture-safe under CUDA graphs (a CPU replay re-runs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefill_core import AttentionLayout, KVBuffers, KVGroup
from prefill_core.kv_groups.windows import window_floor
from prefill_core.values.intmath import ceil_div
from prefill_shell.reference.llama_like.llama import PagedLlama, _rms_norm, _split_qkv
from prefill_shell.reference.pools.kv_cache import PagedKVCache

__all__ = ["GroupedKVCache", "GroupTensors", "forward_grouped", "llama_body", "windowed_attention"]


class GroupTensors(NamedTuple):
    """One group's staged step (``prefill_core.GroupStepTables`` as tensors and host ints).

    ``fill`` int ``[B, Wf]``; ``read`` int ``[B, Wr]`` (chunked steps);
    ``read_from`` each row's first readable column; ``reused`` each row's
    positions ``(lo, hi)`` whose K/V come from the pool.
    """

    fill: torch.Tensor
    read: torch.Tensor | None
    read_from: tuple[int, ...]
    reused: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, tables) -> GroupTensors:
        """The tensors of a core ``GroupStepTables``."""
        read = None if tables.read is None else torch.tensor(tables.read, dtype=torch.int32)
        return cls(torch.tensor(tables.fill, dtype=torch.int32), read, tables.read_from, tables.reused)


class GroupedKVCache:
    """KV buffers shared by a hybrid model's KV groups, as vLLM plans them, and one ``PagedKVCache`` view per group.

    ``buffers`` (``prefill_core.KVBuffers``; default ``KVBuffers.shared``:
    a layer's buffer is its position in its group) names the K and the V
    buffer of each layer, ``[num_blocks, H_kv, block_size, D]`` each, with no
    sink block: layer i of every group is a view of buffer i, so the pool's
    bytes are vLLM's plan (``num_blocks`` pages per KV tensor). A block id
    belongs to one group at a time (``prefill_core.kv_groups.group_rules``), so sharing
    never lets one group read or write another's page. ``pools[g]`` is group
    g's layers over their buffers.
    """

    def __init__(
        self,
        attention: AttentionLayout,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        buffers: KVBuffers | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        buffers = KVBuffers.shared(attention) if buffers is None else buffers
        if buffers.attention != attention:
            raise ValueError("GroupedKVCache: buffers were assigned for another attention layout")
        if min(num_blocks, num_kv_heads, head_dim) <= 0:
            raise ValueError("GroupedKVCache dimensions must all be positive")
        self.attention, self.buffers, self.num_blocks = attention, buffers, num_blocks
        # Created outside inference mode on purpose: tests and callers may overwrite the buffers in place.
        shapes = [(num_blocks, num_kv_heads, buffers.block_size_of(b), head_dim) for b in range(buffers.num_buffers)]
        self.keys = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in shapes)
        self.values = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in shapes)
        index = buffers.buffer_of
        self.pools = tuple(
            PagedKVCache.over(
                [self.keys[index[layer]] for layer in g.layers],
                [self.values[index[layer]] for layer in g.layers],
                g.block_size,
            )
            for g in attention.groups
        )
        self._where = {
            layer: (g, i) for g, group in enumerate(attention.groups) for i, layer in enumerate(group.layers)
        }
        # What the runtime's config checks a pool against (engine/config.py).
        self.block_size = max(g.block_size for g in attention.groups)  # the planning block: chunk starts align to it
        self.num_layers, self.num_kv_heads, self.head_dim = attention.num_layers, num_kv_heads, head_dim
        self.dtype = dtype

    def of_layer(self, layer: int) -> tuple[PagedKVCache, int, KVGroup, int]:
        """``(pool, layer within it, group, group index)`` of model layer ``layer``."""
        g, local = self._where[layer]
        return self.pools[g], local, self.attention.groups[g], g

    def allocated_bytes(self) -> int:
        """Bytes of every K and V buffer: what vLLM planned for ``num_blocks`` blocks of this layout."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def block_bytes(self, block: int) -> torch.Tensor:
        """Raw bytes of block ``block`` in every buffer (flat uint8, each buffer once), for bit-exact comparisons."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block={block} is not addressable (pool has {self.num_blocks} blocks)")
        pages = [t[block].contiguous().view(torch.uint8).flatten() for t in self.keys + self.values]
        return torch.cat(pages).clone()


def _key_mask(
    starts: list[int], seq: int, first: int, columns: int, bs: int, window: int | None, device
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(readable [B, 1, P, 1] | None, mask [B, 1, S, P + S])`` over keys ``[gathered prefix | chunk]``.

    The prefix holds positions ``first*bs .. (first + columns)*bs - 1``; a
    gathered position is readable when ``window_floor(start) <= p < start``.
    """
    start = torch.tensor(starts, dtype=torch.int64, device=device)[:, None]  # [B, 1]
    queries = start + torch.arange(seq, device=device)  # [B, S]
    prefix = first * bs + torch.arange(columns * bs, device=device)  # [P]
    floor = torch.tensor([window_floor(s, window) for s in starts], dtype=torch.int64, device=device)[:, None]
    readable = (prefix[None, :] >= floor) & (prefix[None, :] < start)  # [B, P]
    keys = torch.cat((prefix.expand(len(starts), -1), queries), dim=1)  # [B, P + S]
    visible = keys[:, None, :] <= queries[:, :, None]  # [B, S, P + S]
    if window is not None:
        visible &= keys[:, None, :] > queries[:, :, None] - window
    own = torch.ones(len(starts), seq, dtype=torch.bool, device=device)
    visible &= torch.cat((readable, own), dim=1)[:, None, :]
    return (readable[:, None, :, None] if columns else None), visible[:, None]


def _reuse_cached(pool: PagedKVCache, local: int, x: torch.Tensor, which: int, starts, tables: GroupTensors):
    """``x`` (``[B, Hkv, S, D]`` keys or values) with each row's reused positions read from the pool."""
    bs, out = pool.block_size, None
    for b, ((lo, hi), start) in enumerate(zip(tables.reused, starts)):
        if lo >= hi:
            continue
        first = lo // bs
        old = pool.gather(local, tables.read[b : b + 1, first : ceil_div(hi, bs)])[which]  # [1, Hkv, P, D]
        out = x.clone() if out is None else out
        out[b, :, lo - start : hi - start] = old[0, :, lo - first * bs : hi - first * bs].to(x.dtype)
    return x if out is None else out


def windowed_attention(model, layer: int, q, k, v, starts: list[int], tables: GroupTensors, kv):
    """SDPA of one layer over its group's window; ``q [B, H, S, D]``, ``k, v [B, Hkv, S, D]``.

    ``model._sdpa`` computes the attention itself (its grouped-query form and
    its scale: ``PagedLlama``'s or ``PagedGemma3``'s).
    """
    pool, local, group, _ = kv.of_layer(layer)
    if any(lo < hi for lo, hi in tables.reused):
        k = _reuse_cached(pool, local, k, 0, starts, tables)
        v = _reuse_cached(pool, local, v, 1, starts, tables)
    pool.fill(local, k, v, tables.fill)
    seq, bs = q.shape[2], group.block_size
    floors = [max(window_floor(s, group.window) // bs, f) for s, f in zip(starts, tables.read_from)]
    first = min(floors)
    columns = max(0, max(ceil_div(s, bs) for s in starts) - first) if tables.read is not None else 0
    readable, mask = _key_mask(starts, seq, first, columns, bs, group.window, q.device)
    if columns:
        old_k, old_v = pool.gather(local, tables.read[:, first : first + columns])  # [B, Hkv, P, D]
        old_k = torch.where(readable, old_k, 0.0).to(k.dtype)
        old_v = torch.where(readable, old_v, 0.0).to(v.dtype)
        k, v = torch.cat((old_k, k), dim=2), torch.cat((old_v, v), dim=2)
    return model._sdpa(q, k, v, attn_mask=mask)


def llama_body(model: PagedLlama, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
    """The reference Llama over ``tokens [B, S]`` at ``positions [B, S]``; ``attend(layer, q, k, v)`` (``q [B, H,
    S, D]``, ``k, v [B, Hkv, S, D]``, rotated) is each layer's attention. Returns hidden ``[B, S, H]``."""
    config, spec = model.config, model.spec
    batch, seq = tokens.shape
    positions = positions.clamp(max=config.max_position_embeddings - 1)  # padded tails feed no real query
    cos = model._cos[positions].to(model.dtype).unsqueeze(2)
    sin = model._signed_sin[positions].to(model.dtype).unsqueeze(2)
    residual = F.embedding(tokens, model._embed).view(batch * seq, -1)
    eps = config.rms_norm_eps
    for i, layer in enumerate(model._layers):
        normed = _rms_norm(residual, layer.attn_norm, eps).view(batch, seq, -1)
        q, k, v = (t.transpose(1, 2) for t in _split_qkv(layer.qkv(normed), config, layer, cos, sin))
        out = attend(i, q, k, v)
        attn = out.transpose(1, 2).reshape(batch * seq, spec.num_heads * spec.head_dim)
        residual = layer.o.plus(attn, residual)
        residual = model._mlp(layer, _rms_norm(residual, layer.mlp_norm, eps), residual)
    return _rms_norm(residual, model._final_norm, eps).view(batch, seq, -1)


@torch.inference_mode()
def forward_grouped(
    model,
    tokens: torch.Tensor,
    start: torch.Tensor,
    tables: Sequence[GroupTensors],
    kv: GroupedKVCache,
) -> torch.Tensor:
    """One padded step (``tokens [B, S]`` from ``start [B]``) of a hybrid model; returns hidden ``[B, S, H]``.

    ``tables[g]`` are group g's tables for the step, as the core staged them.
    ``model`` is a ``PagedLlama`` or a decoder with its own layer (``PagedGemma3``: its ``body``).
    """
    starts = [int(s) for s in start.tolist()]
    positions = start.to(torch.int64)[:, None] + torch.arange(tokens.shape[1], device=tokens.device)

    def attend(i, q, k, v):
        return windowed_attention(model, i, q, k, v, starts, tables[kv.of_layer(i)[3]], kv)

    body = llama_body if isinstance(model, PagedLlama) else type(model).body
    return body(model, tokens, positions, attend)
