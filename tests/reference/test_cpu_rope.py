"""The rotary and pool-write kernel of packed steps (prefill_shell/reference/cpu_kernels/rope.py) against
transformers' own apply_rotary_pos_emb, and the pool slots it writes against the slots asked for."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from prefill_shell.reference.cpu_kernels import library
from prefill_shell.reference.cpu_kernels import rope as rope_module
from prefill_shell.reference.cpu_kernels.rope import ROPE_TOKENS, rope_step
from prefill_shell.reference.llama_like.rope import rope_inv_freq
from prefill_shell.reference.pools.kv_cache import PagedKVCache

BS = 16
DTYPES = [
    pytest.param(
        dtype, marks=pytest.mark.skipif(dtype not in library.kernel_dtypes(), reason=f"no CPU kernel at {dtype} here")
    )
    for dtype in (torch.float32, torch.bfloat16)
]


def tables(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos and sin for ``positions`` (float32, then the model dtype), and the kernel's signed sin."""
    freqs = torch.outer(positions.float(), rope_inv_freq(10000.0, dim, None))
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return cos, sin, torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 64), (9, 3, 64), (4, 2, 128), (2, 2, 32)])
def test_rotated_heads_are_transformers_bits_and_slots_are_written(heads, kv_heads, dim, dtype):
    """Q and K rotated exactly as apply_rotary_pos_emb rotates them at the model dtype; each token's K and V land
    in its slot, a -1 slot writes nothing, and no other slot of the pool changes."""
    gen = torch.Generator().manual_seed(dim)
    tokens = 45
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim))
    v = qkv[:, (heads + kv_heads) * dim :].unflatten(-1, (kv_heads, dim))
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin, signed_sin = tables(positions, dim, dtype)
    kv = PagedKVCache(2, 8, BS, kv_heads, dim, dtype=dtype)
    for pool in (*kv.keys, *kv.values):
        pool.fill_(math.nan)
    slots = torch.randperm(7 * BS, generator=gen)[:tokens]
    slots[::5] = -1
    step = rope_step(cos, signed_sin, slots, kv, heads, kv_heads)
    q, k, v_out = step(kv, 1, qk, v)

    expected_q, expected_k = apply_rotary_pos_emb(
        qk[None, :, :heads].transpose(1, 2), qk[None, :, heads:].transpose(1, 2), cos[None], sin[None]
    )
    assert torch.equal(q, expected_q[0].transpose(0, 1))
    assert torch.equal(k, expected_k[0].transpose(0, 1))
    assert v_out is v
    written = torch.zeros(kv.keys[1].shape[0], BS, dtype=torch.bool)  # the blocks and the sink
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, BS)
        written[block, offset] = True
        assert torch.equal(kv.keys[1][block, :, offset], k[t]) and torch.equal(kv.values[1][block, :, offset], v[t])
    for pool in (kv.keys[1], kv.values[1]):
        assert pool.transpose(1, 2)[~written].isnan().all()  # nothing else was written
    for pool in (kv.keys[0], kv.values[0]):
        assert pool.isnan().all()  # nor another layer


@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_change_no_bit(dtype):
    """Tokens enough to be shared out: the same bits on one thread or several."""
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 4096, 8, 4, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim))
    v = qkv[:, (heads + kv_heads) * dim :].unflatten(-1, (kv_heads, dim))
    cos, _, signed_sin = tables(torch.arange(tokens), dim, dtype)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            kv = PagedKVCache(1, tokens // BS + 1, BS, kv_heads, dim, dtype=dtype)
            step = rope_step(cos, signed_sin, torch.arange(tokens), kv, heads, kv_heads)
            assert step.threads == 0  # shared out: torch's thread count
            q, k, _ = step(kv, 0, qk, v)
            results.append((q, k, kv.keys[0].clone(), kv.values[0].clone()))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.skipif(torch.float32 not in library.kernel_dtypes(), reason="no CPU kernels here")
def test_where_it_does_not_apply_or_does_not_match():
    """A head size not a multiple of 32, a pool in another dtype or a slot past the pool: None (torch's ops);
    tensors that are not the step's: refused before the kernel reads them."""
    cos, _, sin = tables(torch.arange(10), 64, torch.float32)
    kv = PagedKVCache(1, 2, BS, 2, 64, dtype=torch.float32)
    slots = torch.arange(10)
    assert rope_step(cos[:, :48], sin[:, :48], slots, kv, 4, 2) is None
    assert rope_step(cos, sin, slots, PagedKVCache(1, 2, BS, 2, 64, dtype=torch.float64), 4, 2) is None
    assert rope_step(cos, sin, slots + kv.keys[0].shape[0] * BS, kv, 4, 2) is None
    step = rope_step(cos, sin, slots, kv, 4, 2)
    qk, v = torch.randn(10, 6, 64), torch.randn(10, 2, 64)
    with pytest.raises(ValueError, match="qk is torch.float32 \\(9, 6, 64\\)"):
        step(kv, 0, qk[:9], v)
    with pytest.raises(ValueError, match="v is torch.float32 \\(10, 2, 64\\) strides \\(1, 10, 20\\)"):
        step(kv, 0, qk, v.permute(2, 1, 0).contiguous().permute(2, 1, 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens, heads, threads", [(1, 2, 1), (ROPE_TOKENS, 32, 1), (ROPE_TOKENS + 1, 2, 1), (ROPE_TOKENS + 1, 32, 0)]
)
def test_tokens_are_shared_out_from_two_work_items_and_enough_elements(tokens, heads, threads, dtype):
    """One chunk of tokens, or two holding fewer than SHARED_ELEMENTS, rotate on the calling thread alone; more
    on torch's threads (0)."""
    assert (tokens * 3 * heads * 64 >= library.SHARED_ELEMENTS) == (heads == 32 and tokens > 1)
    cos, _, signed_sin = tables(torch.arange(tokens), 64, dtype)
    kv = PagedKVCache(1, tokens // BS + 1, BS, heads, 64, dtype=dtype)
    assert rope_step(cos, signed_sin, torch.arange(tokens), kv, heads, heads).threads == threads


def test_rope_tokens_is_the_kernels_chunk():
    """``ROPE_TOKENS`` (the work item ``threads_for`` counts) is the chunk ``rope.c`` claims, ``TOKENS``."""
    source = Path(rope_module.__file__).with_name("rope.c").read_text()
    assert re.search(r"^#define TOKENS (\d+)$", source, re.M).group(1) == str(ROPE_TOKENS)
