"""Attention of a hybrid model's packed step (``prefill_core.kv_groups.group_packed``): per segment, per KV group.

A packed step's tokens are row segments end to end. In each layer, every
token's fresh K/V is first written into its slot of the layer's group pool
(``contract.GROUP_WRITE_SLOTS``, -1 writes nothing); then each segment's
queries ``[start, start + length)`` attend to the keys transformers' rule
lets them see (``q - window < k <= q``; every earlier key in a full group):
the row's positions before ``start`` gathered from the segment's prefix
columns only (``GROUP_PREFIX_TABLES`` from its first column, as
``GROUP_PREFIX_FROM`` says), and the segment's own fresh keys. Gathered
positions a query may not see are zeroed before they meet it, not only
masked (a masked NaN is still NaN), exactly as the padded step does
(``windowed.py``). No other table entry is read, and nothing but the
step's own slots is written. Eager only: shapes follow each step's segments.
"""

from __future__ import annotations

import torch

from prefill_core.kv_groups.windows import window_floor
from prefill_shell.reference.llama_like.packed_attention import packed_writes, write_packed

__all__ = ["PackedGroupStep", "packed_windowed_attention"]


class PackedGroupStep:
    """One packed step's inputs as the layers read them: segments on the host, per-group tables as tensors."""

    def __init__(self, segments: torch.Tensor, write_slots, prefix_tables, prefix_from, kv):
        self.segments = [tuple(s) for s in segments.tolist()]  # (offset, length, start)
        self.spans = prefix_from.tolist()  # [K][G] = (first column, count)
        self.tables = prefix_tables  # [K, G, Wgp]
        self.writes = [packed_writes(write_slots[g], pool.block_size) for g, pool in enumerate(kv.pools)]


def _segment_keys(pool, local: int, step: PackedGroupStep, g: int, i: int, window, k, v):
    """``(keys, values, positions, readable)`` of segment ``i``'s gathered prefix in group g (``[Hkv, P, D]``
    keys and values, zeroed where ``readable [P]`` is False), or None where it reads no column."""
    offset, length, start = step.segments[i]
    first, count = step.spans[g][i]
    bs = pool.block_size
    if count == 0:
        return None
    old_k, old_v = pool.gather(local, step.tables[g, i : i + 1, :count])  # [1, Hkv, count * bs, D]
    positions = first * bs + torch.arange(count * bs, device=k.device)
    readable = (positions >= window_floor(start, window)) & (positions < start)
    keep = readable[None, :, None]
    old_k = torch.where(keep, old_k[0], 0.0).to(k.dtype)
    old_v = torch.where(keep, old_v[0], 0.0).to(v.dtype)
    return old_k, old_v, positions, readable


def packed_windowed_attention(model, layer: int, q, k, v, step: PackedGroupStep, kv) -> torch.Tensor:
    """``[1, H, T, D]`` from ``q [1, H, T, D]``, ``k, v [1, Hkv, T, D]``: each segment over its group's window."""
    pool, local, group, g = kv.of_layer(layer)
    write_packed(pool, local, k[0].transpose(0, 1), v[0].transpose(0, 1), step.writes[g])
    outputs = []
    for i, (offset, length, start) in enumerate(step.segments):
        span = slice(offset, offset + length)
        q_s, k_s, v_s = q[:, :, span], k[0, :, span], v[0, :, span]
        queries = start + torch.arange(length, device=q.device)
        keys, readable = queries, torch.ones(length, dtype=torch.bool, device=q.device)
        prefix = _segment_keys(pool, local, step, g, i, group.window, k, v)
        if prefix is not None:
            old_k, old_v, old_positions, old_readable = prefix
            k_s, v_s = torch.cat((old_k, k_s), dim=1), torch.cat((old_v, v_s), dim=1)
            keys, readable = torch.cat((old_positions, queries)), torch.cat((old_readable, readable))
        visible = (keys[None, :] <= queries[:, None]) & readable[None, :]  # [length, P + length]
        if group.window is not None:
            visible &= keys[None, :] > queries[:, None] - group.window
        outputs.append(model._sdpa(q_s, k_s[None], v_s[None], attn_mask=visible[None, None]))
    return torch.cat(outputs, dim=2)
