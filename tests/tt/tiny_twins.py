"""The same tiny language model twice: in torch (reference) and in ttnn (device body), for device comparisons.

One attention layer with q = k = v = the token embedding (no projections, no
rotary: causality is the only position effect), a residual add, and a linear
LM head. Small enough to reason about, yet it exercises everything the
runtime drives: paged KV writes through the fill table (``-1`` skips), plain
causal attention for regular prefill, and chunked attention through the read
table from an absolute chunk start (a device tensor) for chunked prefill.
"""

from __future__ import annotations

import math

import torch

from prefill_shell.device.model import ModelSpec

VOCAB, HIDDEN, BLOCK = 256, 64, 32
SPEC = ModelSpec(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=HIDDEN, max_position=1024
)


def twin_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embedding [V, H], head [H, V])``, rounded to bfloat16 so both twins hold identical values."""
    gen = torch.Generator().manual_seed(seed)
    embedding = torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16().float()
    head = (torch.randn(HIDDEN, VOCAB, generator=gen) / math.sqrt(HIDDEN)).bfloat16().float()
    return embedding, head


class TwinKV:
    """One paged pool (keys double as values): ``[num_blocks, ...block]`` and its geometry."""

    def __init__(self, pool, block_size: int, num_blocks: int):
        self.pool = pool
        self.block_size = block_size
        self.num_blocks = num_blocks


class TorchTwin:
    """The reference body on torch (``PrefillModel`` with torch host semantics)."""

    dtype = torch.float32
    spec = SPEC

    def __init__(self, weights):
        self.embedding, self.head = weights

    def new_kv(self, num_blocks: int) -> TwinKV:
        return TwinKV(torch.zeros(num_blocks, BLOCK, HIDDEN), BLOCK, num_blocks)

    def forward_hidden(self, tokens, start, fill_table, read_table, kv):
        x = self.embedding[tokens]  # [B, S, H]
        b, s, _ = x.shape
        for row in range(b):
            for j in range(min(fill_table.shape[1], s // BLOCK)):
                block = int(fill_table[row, j])
                if block >= 0:
                    kv.pool[block] = x[row, j * BLOCK : (j + 1) * BLOCK]
        out = torch.empty_like(x)
        for row in range(b):
            if read_table is None:
                keys, offset = x[row], 0
            else:
                keys, offset = kv.pool[read_table[row].long()].reshape(-1, HIDDEN), int(start[row])
            scores = x[row] @ keys.T / math.sqrt(HIDDEN)  # [S, K]
            visible = torch.arange(keys.shape[0])[None, :] <= offset + torch.arange(s)[:, None]
            out[row] = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ keys
        return x + out

    def lm_head(self, rows):
        return rows.float() @ self.head


class TtnnTwin:
    """The same body on a ttnn mesh: embedding, paged_fill_cache, (chunked) SDPA, add, matmul."""

    dtype = torch.bfloat16
    spec = SPEC

    def __init__(self, ttnn, mesh, weights):
        self.tt, self.mesh = ttnn, mesh
        embedding, head = weights
        self.embedding = ttnn.from_torch(embedding.bfloat16(), layout=ttnn.ROW_MAJOR_LAYOUT, device=mesh)
        self.head = ttnn.from_torch(head.reshape(1, 1, HIDDEN, VOCAB).bfloat16(), layout=ttnn.TILE_LAYOUT, device=mesh)
        grid = mesh.compute_with_storage_grid_size()
        self.sdpa = ttnn.SDPAProgramConfig(
            compute_with_storage_grid_size=grid, q_chunk_size=32, k_chunk_size=32, exp_approx_mode=False
        )
        self._row_ids: dict[int, object] = {}

    def new_kv(self, num_blocks: int) -> TwinKV:
        zeros = torch.zeros(num_blocks, 1, BLOCK, HIDDEN, dtype=torch.bfloat16)
        pool = self.tt.from_torch(zeros, layout=self.tt.TILE_LAYOUT, device=self.mesh)
        return TwinKV(pool, BLOCK, num_blocks)

    def row_ids(self, b: int):
        """``[0..B)`` int32: the batch index of each wave row into the fill table (made at the compile run,
        before any capture, so a trace never allocates it)."""
        if b not in self._row_ids:
            ids = torch.arange(b, dtype=torch.int32)
            self._row_ids[b] = self.tt.from_torch(
                ids, dtype=self.tt.int32, layout=self.tt.ROW_MAJOR_LAYOUT, device=self.mesh
            )
        return self._row_ids[b]

    def forward_hidden(self, tokens, start, fill_table, read_table, kv):
        tt = self.tt
        b, s = int(tokens.shape[-2]), int(tokens.shape[-1])
        x = tt.embedding(tt.reshape(tokens, (b, s)), self.embedding, layout=tt.TILE_LAYOUT)
        x = tt.reshape(x, (b, 1, s, HIDDEN))
        tt.experimental.paged_fill_cache(kv.pool, x, fill_table, batch_idx_tensor=self.row_ids(b))
        if read_table is None:
            attn = tt.transformer.scaled_dot_product_attention(x, x, x, is_causal=True, program_config=self.sdpa)
        else:
            attn = tt.transformer.chunked_scaled_dot_product_attention(
                x, kv.pool, kv.pool, read_table, chunk_start_idx_tensor=start, program_config=self.sdpa
            )
        return tt.add(x, attn)

    def lm_head(self, rows):
        return self.tt.matmul(rows, self.head, dtype=self.tt.float32)
