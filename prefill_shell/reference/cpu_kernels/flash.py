"""One attention call per layer for a whole packed step on the CPU: every segment, its cached prefix read in
place from the paged pool (``flash.c``).

torch's CPU flash kernel takes one segment a call, its prefix gathered and
copied beside the fresh keys first, and reaches a fraction of the machine's
matrix rate at prompt lengths under a thousand (it splits queries into
blocks of 32 or 64 below 768 tokens). This kernel packs each KV head's keys
and values once per call into the layout the dot-product instructions read,
runs every query head of a KV head against each packed block together, and
hands the step's work items (segment, KV head, block of query positions) to
torch's OpenMP threads, each claiming the next one as it finishes.

What a query sees is what ``packed_attention.segment_attention`` gives it:
positions before the segment's ``start`` through its prefix blocks, then its
own keys up to itself. Nothing at or past ``start`` is read from the pool, so
filler, the sink and stale blocks never meet a query.

A ``FlashStep`` is built once per step (``flash_step``) from the step's
segment table and reused by every layer; it is None where the kernel does not
apply (a CUDA tensor, a dtype or head size it lacks, a pool in another dtype,
a prefix block outside the pool), and the caller keeps torch's path.
"""

from __future__ import annotations

import ctypes
import math

import torch

from prefill_core import ceil_div
from prefill_shell.reference.cpu_kernels.library import (
    FlashArgs,
    FlashSegment,
    kernel_dtypes,
    kernel_library,
    run_kernel,
    threads_for,
)
from prefill_shell.reference.pools.kv_cache import PagedKVCache

__all__ = ["BLOCK_KEYS", "FlashStep", "QUERY_ROWS", "SHARED_FLOPS", "flash_step"]

BLOCK_KEYS = 64
"""Keys per packed block (``BK`` in ``flash.c``)."""

SHARED_FLOPS = 2e6
"""A step of less attention work (multiply-adds counted twice) runs on the calling thread: a parallel region
costs microseconds, more than sharing so little saves. The common case is the last layer's attention for
segment ends alone, one query a segment, whose packing outweighs its arithmetic."""

QUERY_ROWS = 64
"""Query rows (positions times the query heads of one KV head) a work item aims at: each packed block it
reads serves that many rows."""


class FlashStep:
    """A packed step's segments as the kernel reads them, and the packing buffers its layers share."""

    def __init__(self, segments: list[tuple[int, int, int]], block_ids: torch.Tensor, block_size: int, heads: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype):  # fmt: skip
        groups = heads // kv_heads
        self.bq = max(1, QUERY_ROWS // groups)
        table = (FlashSegment * len(segments))()
        packed = items = blocks_at = 0
        flops = 0.0
        for entry, (offset, length, start) in zip(table, segments):
            entry.offset, entry.length, entry.start = offset, length, start
            entry.blocks_at, entry.packed_at, entry.items_at = blocks_at, packed, items
            packed += kv_heads * ceil_div(start + length, BLOCK_KEYS)
            items += kv_heads * ceil_div(length, self.bq)
            flops += 4.0 * heads * head_dim * length * (start + (length + 1) / 2)
            blocks_at += ceil_div(start, block_size)  # block_ids holds each cached segment's prefix blocks in turn
        self.table, self.packed, self.items = table, packed, items
        self.threads = threads_for(max(packed, items), flops >= SHARED_FLOPS)  # each phase's items shared out
        self.block_ids = block_ids
        self.pool_blocks = int(block_ids.max()) + 1 if len(block_ids) else 0  # the pool must hold every block read
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        self.scale = 1.0 / math.sqrt(head_dim)
        words = packed * head_dim * BLOCK_KEYS  # one packed K (or V) block is D * BK elements, as pairs at bfloat16
        self._kp = torch.empty(words, dtype=dtype)
        self._vp = torch.empty(words, dtype=dtype)

    def __call__(self, kv: PagedKVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[T, H, D]`` from token-major ``q [T, H, D]`` and fresh ``k, v [T, Hkv, D]``."""
        # The kernel reads raw memory: shapes, dtypes and the pool are checked against the step before it runs.
        total = self.table[-1].offset + self.table[-1].length
        shapes = ((total, self.heads, self.head_dim), *((total, self.kv_heads, self.head_dim),) * 2)
        for name, x, shape in zip("qkv", (q, k, v), shapes):
            if tuple(x.shape) != shape or x.dtype != self.dtype or x.device.type != "cpu":
                raise ValueError(
                    f"{name} is {x.dtype} {tuple(x.shape)} on {x.device}, the step needs {self.dtype} {shape}"
                )
        for pool in (kv.keys[layer], kv.values[layer]):
            if pool.dtype != self.dtype or pool.shape[0] < self.pool_blocks or not pool.is_contiguous():
                raise ValueError(f"the pool's layer {layer} ({pool.dtype} {tuple(pool.shape)}) is not the step's")
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # rows of D elements side by side
        out = torch.empty(q.shape, dtype=q.dtype)
        args = FlashArgs(
            q=q.data_ptr(), q_st=q.stride(0), q_sh=q.stride(1),
            k=k.data_ptr(), k_st=k.stride(0), k_sh=k.stride(1), v=v.data_ptr(), v_st=v.stride(0), v_sh=v.stride(1),
            pool_k=kv.keys[layer].data_ptr(), pool_v=kv.values[layer].data_ptr(), bs=kv.block_size,
            o=out.data_ptr(), o_st=out.stride(0), o_sh=out.stride(1),
            H=self.heads, Hkv=self.kv_heads, D=self.head_dim, bq=self.bq, scale=self.scale,
            nseg=len(self.table), seg=ctypes.addressof(self.table), block_ids=self.block_ids.data_ptr(),
            packed=self.packed, items=self.items, next_pack=0, next_item=0,
        )  # fmt: skip
        bf16 = int(self.dtype == torch.bfloat16)
        pointers = (ctypes.byref(args), self._kp.data_ptr(), self._vp.data_ptr(), bf16, self.threads)
        run_kernel("prefill::flash_attention", kernel_library().flash_run, *pointers)
        return out


def flash_step(
    segments: torch.Tensor, prefix_table: torch.Tensor, kv: PagedKVCache, heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype, total: int,
) -> FlashStep | None:  # fmt: skip
    """The kernel's view of a packed step's ``[G, 3]`` segment table (offset, length, start), or None where
    it does not apply. Segments must tile the step's ``total`` tokens in order, as packed steps lay them."""
    if segments.device.type != "cpu" or dtype not in kernel_dtypes() or kv.dtype != dtype:
        return None
    if head_dim % 64 or heads % kv_heads or any(not t.is_contiguous() for t in (*kv.keys, *kv.values)):
        return None
    rows = segments.tolist()
    if not rows:
        return None
    ids: list[torch.Tensor] = []
    expected = 0
    for i, (offset, length, start) in enumerate(rows):
        if offset != expected or length <= 0 or start < 0:
            return None
        expected = offset + length
        if start:
            ids.append(prefix_table[i, : ceil_div(start, kv.block_size)].to(torch.int64))
    if expected != total:
        return None
    block_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    if ids and not bool(((block_ids >= 0) & (block_ids < kv.keys[0].shape[0])).all()):
        return None  # a prefix position without a block: torch's path decides what that means
    return FlashStep(rows, block_ids.contiguous(), kv.block_size, heads, kv_heads, head_dim, dtype)
