"""Rotary embedding of a packed step's Q and K heads and its K/V pool writes, in one pass on the CPU
(``rope.c``).

torch applies the half-split rotation as three passes (the halves swapped
into a copy, one product, a multiply-add) and then scatters K and V into the
pool with two indexed writes. The kernel reads each token's Q/K/V once,
writes its rotated Q and K heads, and copies its K and V heads into the
token's pool slot, rounding as transformers does (``q * cos`` and
``rotate_half(q) * sin`` each rounded to the model dtype, then their sum).
A ``RopeStep`` is built once per step (``rope_step``) and reused by every
layer; it is None where the kernel does not apply (a CUDA tensor, a dtype or
head size it lacks, a pool in another dtype, a slot outside the pool).
"""

from __future__ import annotations

import ctypes

import torch

from prefill_shell.reference.cpu_kernels.library import (
    SHARED_ELEMENTS,
    RopeArgs,
    kernel_dtypes,
    kernel_library,
    run_kernel,
    threads_for,
)
from prefill_shell.reference.pools.kv_cache import PagedKVCache

__all__ = ["ROPE_TOKENS", "RopeStep", "rope_step"]

ROPE_TOKENS = 16
"""Tokens a thread claims at a time (``TOKENS`` in ``rope.c``): one work item."""


class RopeStep:
    """A packed step's rotary tables (``[T, D]`` in the model dtype) and write slots (``[T]``, -1: none)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int):
        self.cos, self.sin, self.slots = cos, sin, slots
        self.heads, self.kv_heads = heads, kv_heads
        tokens, dim = cos.shape
        self.highest_slot = int(slots.max()) if len(slots) else -1  # read once per step, not per layer
        elements = tokens * (heads + 2 * kv_heads) * dim
        self.threads = threads_for(-(-tokens // ROPE_TOKENS), elements >= SHARED_ELEMENTS)

    def __call__(
        self, kv: PagedKVCache, layer: int, qk: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated ``q [T, H, D]``, ``k [T, Hkv, D]`` and ``v`` from ``qk [T, H + Hkv, D]`` and ``v [T, Hkv, D]``
        (views whose heads lie ``D`` apart); K and V written into ``layer``'s pool slots."""
        tokens, dim = self.cos.shape
        dtype = self.cos.dtype
        for name, x, heads in (("qk", qk, self.heads + self.kv_heads), ("v", v, self.kv_heads)):
            if tuple(x.shape) != (tokens, heads, dim) or x.dtype != dtype or x.stride()[1:] != (dim, 1):
                raise ValueError(f"{name} is {x.dtype} {tuple(x.shape)} strides {x.stride()}, the step needs {dtype}")
        pool_k, pool_v = kv.keys[layer], kv.values[layer]
        for pool in (pool_k, pool_v):
            if pool.dtype != dtype or pool.numel() < self.pool_size(kv.block_size, dim):
                raise ValueError(f"the pool's layer {layer} ({pool.dtype} {tuple(pool.shape)}) is not the step's")
        out = torch.empty(tokens, self.heads + self.kv_heads, dim, dtype=dtype)
        args = RopeArgs(
            qk=qk.data_ptr(), qk_st=qk.stride(0), v=v.data_ptr(), v_st=v.stride(0),
            cos=self.cos.data_ptr(), sin=self.sin.data_ptr(), out=out.data_ptr(),
            pool_k=pool_k.data_ptr(), pool_v=pool_v.data_ptr(), slots=self.slots.data_ptr(), bs=kv.block_size,
            T=tokens, H=self.heads, Hkv=self.kv_heads, D=dim, next=0,
        )  # fmt: skip
        run_kernel("prefill::rope_write", kernel_library().rope_write, ctypes.byref(args), dtype.itemsize, self.threads)
        return out[:, : self.heads], out[:, self.heads :], v

    def pool_size(self, block_size: int, dim: int) -> int:
        """Elements a pool layer must hold for the step's highest slot."""
        highest = self.highest_slot
        return (highest // block_size + 1) * self.kv_heads * block_size * dim if highest >= 0 else 0


def rope_step(
    cos: torch.Tensor, sin: torch.Tensor, write_slots: torch.Tensor, kv: PagedKVCache, heads: int, kv_heads: int
) -> RopeStep | None:
    """The kernel's view of a packed step's rotary tables ``[T, D]`` and write slots ``[T]``, or None."""
    dtype = cos.dtype
    if cos.device.type != "cpu" or dtype not in kernel_dtypes() or kv.dtype != dtype or cos.shape[1] % 32:
        return None
    if any(not t.is_contiguous() for t in (*kv.keys, *kv.values)):
        return None
    slots = write_slots.to(torch.int64).contiguous()
    if len(slots) and int(slots.max()) >= kv.keys[0].shape[0] * kv.block_size:
        return None  # a slot past the pool: torch's indexed write raises for it
    return RopeStep(cos.contiguous(), sin.contiguous(), slots, heads, kv_heads)
