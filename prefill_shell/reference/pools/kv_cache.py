"""A paged KV pool in tt-metal's layout, plus a write-only sink block.

Each layer owns a K pool and a V pool shaped
``[num_blocks + 1, num_kv_heads, block_size, head_dim]``. Blocks
``0 .. num_blocks-1`` are addressable by page tables. Block ``num_blocks`` is
the *sink*: page-table entries of ``-1`` ("write nothing") are redirected to
it so that a fill is one static-shape index copy with no data-dependent
branching, which keeps the write capturable in a CUDA graph. The sink is
write-only scratch: its contents are garbage, never read by attention and
never exposed by ``snapshot``.

``PagedKVCache.over`` views buffers someone else allocated (a hybrid
model's shared buffers, ``windowed.GroupedKVCache``): exactly
``num_blocks`` deep, as vLLM plans them, so there is no sink and a fill
drops its ``-1`` entries (a data-dependent index, fine for the eager-only
hybrid steps).
"""

from __future__ import annotations

import torch

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Per-layer paged K/V pools that a ``PrefillModel`` fills and reads."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("PagedKVCache dimensions must all be positive")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks + 1, num_kv_heads, block_size, head_dim)
        # Created outside inference mode on purpose: tests and callers may
        # overwrite the pools in place with ordinary tensor code.
        self.keys = tuple(torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers))
        self.values = tuple(torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers))
        self.has_sink = True

    @classmethod
    def over(cls, keys, values, block_size: int) -> PagedKVCache:
        """A pool whose layer i is ``keys[i]`` / ``values[i]`` (``[num_blocks, H_kv, block_size, D]``, no sink)."""
        pool = cls.__new__(cls)
        num_blocks, heads, bs, dim = keys[0].shape
        if bs != block_size or any(t.shape != keys[0].shape for t in (*keys, *values)):
            raise ValueError(f"PagedKVCache.over: every buffer must be [num_blocks, H_kv, {block_size}, D]")
        pool.num_layers, pool.num_blocks, pool.block_size = len(keys), num_blocks, block_size
        pool.num_kv_heads, pool.head_dim, pool.dtype, pool.device = heads, dim, keys[0].dtype, keys[0].device
        pool.keys, pool.values, pool.has_sink = tuple(keys), tuple(values), False
        return pool

    @property
    def sink_block(self) -> int:
        """Index of the write-only scratch block that absorbs ``-1`` entries (past the buffers without one)."""
        return self.num_blocks

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, fill_table: torch.Tensor) -> None:
        """Writes fresh K/V of one layer into the blocks ``fill_table`` names.

        Args:
            layer: layer index.
            k, v: ``[B, H_kv, S, D]`` for the wave's ``S`` tokens.
            fill_table: int ``[B, Wf]``; column ``j`` receives tokens
                ``j*bs .. (j+1)*bs - 1``; ``-1`` writes nothing (goes to the sink).
        """
        batch, heads, seq, dim = k.shape
        bs = self.block_size
        # Python ints from shapes only: the column count is static under capture.
        cols = min(fill_table.shape[1], seq // bs)
        if cols == 0:
            return
        ids = fill_table[:, :cols].to(torch.int64)
        k_blocks = _to_blocks(k[:, :, : cols * bs], bs).to(self.dtype)
        v_blocks = _to_blocks(v[:, :, : cols * bs], bs).to(self.dtype)
        if not self.has_sink:
            kept = torch.nonzero(ids.reshape(-1) >= 0).flatten()
            ids, k_blocks, v_blocks = ids.reshape(-1)[kept], k_blocks[kept], v_blocks[kept]
        ids = torch.where(ids < 0, torch.full_like(ids, self.sink_block), ids).reshape(-1)
        # Several -1 entries all land on the sink; which copy wins there is
        # unspecified, which is harmless because the sink is never read.
        self.keys[layer].index_copy_(0, ids, k_blocks)
        self.values[layer].index_copy_(0, ids, v_blocks)

    def gather(self, layer: int, read_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reads K/V of absolute positions ``[0, Wr*bs)`` for every row.

        Args:
            read_table: int ``[B, Wr]`` of addressable block ids (no ``-1``).

        Returns:
            ``(k, v)``, each ``[B, H_kv, Wr*bs, D]``.
        """
        ids = read_table.to(torch.int64)
        return _from_blocks(self.keys[layer][ids]), _from_blocks(self.values[layer][ids])

    def snapshot(self) -> torch.Tensor:
        """A clone of every addressable block: ``[L, 2 (K,V), num_blocks, H_kv, bs, D]``."""
        n = self.num_blocks
        per_layer = [torch.stack((k[:n], v[:n])) for k, v in zip(self.keys, self.values)]
        return torch.stack(per_layer).clone()

    def allocated_bytes(self) -> int:
        """Bytes of every layer's K and V pool, the sink block included where there is one."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def block_bytes(self, block: int) -> torch.Tensor:
        """Raw bytes of one addressable block over all layers, for bit-exact comparisons.

        Returns a uint8 clone ``[L, 2, H_kv, bs, D * itemsize]``; comparing bytes
        rather than floats makes NaN and signed zero compare as stored.
        """
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block={block} is not addressable (pool has {self.num_blocks} blocks)")
        stacked = torch.stack([torch.stack((k[block], v[block])) for k, v in zip(self.keys, self.values)])
        return stacked.contiguous().view(torch.uint8).clone()


def _to_blocks(x: torch.Tensor, bs: int) -> torch.Tensor:
    """[B, H, W*bs, D] -> [B*W, H, bs, D], block-major to match the page-table order."""
    batch, heads, seq, dim = x.shape
    blocks = x.reshape(batch, heads, seq // bs, bs, dim).transpose(1, 2)
    return blocks.reshape(batch * (seq // bs), heads, bs, dim)


def _from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[B, W, H, bs, D] -> [B, H, W*bs, D]."""
    batch, width, heads, bs, dim = blocks.shape
    return blocks.transpose(1, 2).reshape(batch, heads, width * bs, dim)
