"""A STAND-IN TTTv2 hybrid model: the reference Llama's layers on the host, each KV group's attention on ttnn.

``ReferenceHybridStandIn`` declares ``group_tables = True`` and takes the
adapter's hybrid ``prefill_forward`` keywords (``prefill_shell.tt.adapter``'s
module doc) with no ``**kwargs``: it refuses a single ``page_table`` or
``chunk_page_table``, runs the reference Llama's layers (``llama_body``) on
the host and, per layer, does what a TTTv2 layer of that layer's KV group
would: writes the step's K/V through the group's fill table (a step starting
inside a cached block first takes ``group_reused``'s positions from the
pool) and attends through ``prefill_shell.tt.window_attention`` on the
emulation, i.e. ``chunked_scaled_dot_product_attention``'s golden with the
group's window as ``sliding_window_size``, over the group's read table from
the chunk start (a regular step reads its own fill table from 0, the filler 0
where it writes nothing). Its pools are a ``GroupedKVCache`` (block 0 is the
finite read filler, never written).
"""

from __future__ import annotations

import torch

from prefill_core.values.intmath import ceil_div
from prefill_shell.reference.llama_like.llama import PagedLlama
from prefill_shell.reference.windows.windowed import GroupedKVCache, GroupTensors, _reuse_cached, llama_body
from prefill_shell.tt.window_attention import group_chunked_attention
from tests.tt.reference_standin import ReferenceLlamaStandIn


class ReferenceHybridStandIn(ReferenceLlamaStandIn):
    """``TtHybridModel``: a bfloat16 ``PagedLlama`` over a ``GroupedKVCache`` (see module doc)."""

    group_tables = True

    def __init__(self, emulation, llama: PagedLlama, kv: GroupedKVCache):
        super().__init__(emulation, llama, kv)
        self.attended: list[tuple[int, int | None]] = []  # (layer, window) of each attention call

    def prefill_forward(
        self,
        x_embed,
        rot_mats,
        user_id=0,
        page_table=None,
        chunk_page_table=None,
        chunk_start_idx=None,
        get_last_token=-1,
        batch_size=1,
        chunk_start_idx_tensor=None,
        last_token_slice=None,
        last_token_index=None,
        group_fill_tables=None,
        group_read_tables=None,
        group_read_from=None,
        group_reused=None,
        kv_groups=None,
    ):
        if page_table is not None or chunk_page_table is not None:
            raise ValueError("a hybrid step's tables come per KV group: page_table and chunk_page_table must be None")
        if group_fill_tables is None or group_read_from is None or group_reused is None or not kv_groups:
            raise ValueError("a hybrid step needs group_fill_tables, group_read_from, group_reused and kv_groups")
        chunked = chunk_start_idx_tensor is not None
        if chunked != (group_read_tables is not None) or get_last_token != -1 or chunk_start_idx is not None:
            raise ValueError("group_read_tables is given exactly for a chunked step (start as a tensor)")
        rows = 1 if chunked else batch_size
        self.calls.append(dict(user_id=user_id, batch_size=batch_size, chunked=chunked))
        group_of = {layer: g for g, group in enumerate(kv_groups) for layer in group.layers}

        def body(x, cos, sin, fills, reads, firsts, spans, start):
            tokens = self._token_ids(x).reshape(rows, -1)  # [B, S]
            start = torch.zeros(rows, dtype=torch.int64) if start is None else start.reshape(-1)
            self._check_rotary(cos, sin, int(start[0]), tokens.shape[1])
            tables = [
                GroupTensors(
                    fills[g].to(torch.int32),
                    None if reads is None else reads[g].to(torch.int32),
                    tuple(firsts[g].tolist()),
                    tuple(map(tuple, spans[g].tolist())),
                )
                for g in range(len(kv_groups))
            ]

            def attend(layer, q, k, v):
                g = group_of[layer]
                return self._attend(layer, kv_groups[g], tables[g], q, k, v, int(start[0]))

            positions = start[:, None] + torch.arange(tokens.shape[1])
            hidden = llama_body(self.llama, tokens, positions, attend)  # [B, S, H] after the final norm
            return hidden.reshape(1, 1, -1, hidden.shape[-1])

        inputs = [
            x_embed,
            *rot_mats,
            group_fill_tables,
            group_read_tables,
            group_read_from,
            group_reused,
            chunk_start_idx_tensor,
        ]
        return self._call("prefill_forward", body, inputs, self.tt.bfloat16)

    def _attend(self, layer, group, tables: GroupTensors, q, k, v, start: int):
        """One layer as a TTTv2 layer of ``group`` runs it: write through the fill table, then chunked SDPA."""
        pool, local, _, _ = self.kv.of_layer(layer)
        if tables.read is not None and any(lo < hi for lo, hi in tables.reused):
            k = _reuse_cached(pool, local, k, 0, [start], tables)
            v = _reuse_cached(pool, local, v, 1, [start], tables)
        pool.fill(local, k, v, tables.fill)
        if tables.read is None:  # regular: the step's own blocks from 0; the filler where nothing is written
            read = tables.fill.clamp(min=0)
            need = ceil_div(q.shape[2], group.block_size)
            read = torch.nn.functional.pad(read, (0, max(0, need - read.shape[1])))
        else:
            read = tables.read
        self.attended.append((layer, group.window))
        emu, tt = self.emu, self.tt
        device = [
            self._on_device(value, dtype)
            for value, dtype in (
                (q.float(), tt.float32),
                (pool.keys[local].float(), tt.float32),
                (pool.values[local].float(), tt.float32),
                (read.to(torch.int32), tt.int32),
                (torch.tensor([start], dtype=torch.int32), tt.int32),
            )
        ]
        out = group_chunked_attention(emu, *device, group)
        result = emu.to_torch(emu.from_device(out)).to(q.dtype)
        for tensor in (*device, out):
            emu.deallocate(tensor)
        return result

    def _on_device(self, value: torch.Tensor, dtype):
        tt = self.tt
        return self.emu.to_device(tt.from_torch(value, dtype=dtype, layout=tt.ROW_MAJOR_LAYOUT), self.emu.mesh)
