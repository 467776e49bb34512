"""A STAND-IN TTTv2 model: the reference Llama run on the host, behind ``TtModel``'s exact signatures.

No ttnn model runs without a device, so ``ReferenceLlamaStandIn``
implements ``prefill_shell.tt.adapter.TtModel`` with the keyword lists of
tt-metal's prefill runtime and no ``**kwargs`` (a keyword the adapter
invents is a ``TypeError``). Each method converts the ttnn tensors it gets
to torch, runs ``prefill_shell.reference.PagedLlama`` (the torch backend's
model, bfloat16) through its public API and converts back, by
``ReferenceEmulation.host_call``, so a trace records and replays it.

It checks what the adapter hands it instead of trusting it: the embeddings
must be rows of the embedding table (they are mapped back to token ids),
the rotary tables must be those of the positions the chunk start implies
(clamped to the table's last row, as tt-metal's runtime stages them; a
position past the table is an error, as a device gather would read past it),
``user_id`` must match ``batch_size``, and the tables go where the slot
names say (regular: ``page_table`` fills; chunked: ``chunk_page_table``
fills, ``page_table`` is read). Unlike a TTTv2 model, its ``prefill_forward``
returns the hidden states after the final norm (the reference's public
``forward_hidden``), so ``post_process_prefill_output`` applies only the LM
head; the adapter delegates both, so it calls them the same way either way.
"""

from __future__ import annotations

import torch

from prefill_shell.reference.llama_like.llama import PagedLlama, rope_inv_freq
from prefill_shell.reference.pools.kv_cache import PagedKVCache

TILE = 32


class ReferenceLlamaStandIn:
    """``TtModel`` over a bfloat16 ``PagedLlama`` and its own ``PagedKVCache`` (see module doc)."""

    def __init__(self, emulation, llama: PagedLlama, kv: PagedKVCache):
        self.emu, self.tt = emulation, emulation.ttnn
        self.llama = llama
        self.kv = kv
        self.embedding = llama.state_dict()["model.embed_tokens.weight"]  # [V, H]
        positions = torch.arange(llama.config.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, rope_inv_freq(llama.config)).repeat(1, 2)  # [P, D]
        self.cos, self.sin = angles.cos().to(llama.dtype), angles.sin().to(llama.dtype)
        self.calls: list[dict] = []

    def _call(self, name, fn, inputs, dtype):
        return self.emu.host_call(f"stand-in.{name}", fn, inputs, dtype, self.tt.TILE_LAYOUT)

    def embed_prefill(self, tokens):
        def embed(ids):
            return self.embedding[ids.reshape(-1)].reshape(1, 1, -1, self.embedding.shape[1])

        return self._call("embed_prefill", embed, [tokens], self.tt.bfloat16)

    def prepare_prefill_rot_mats(self, position_indices):
        cos = self._call("rotary_cos", lambda pos: self._rows(self.cos, pos), [position_indices], self.tt.bfloat16)
        sin = self._call("rotary_sin", lambda pos: self._rows(self.sin, pos), [position_indices], self.tt.bfloat16)
        return cos, sin

    @staticmethod
    def _rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The table rows at ``positions``; past the table is an error (a device ``ttnn.embedding`` reads past it)."""
        positions = positions.reshape(-1)
        if int(positions.max()) >= table.shape[0]:
            raise ValueError(f"position {int(positions.max())} is past the {table.shape[0]}-row rotary table")
        return table[positions][None, None]

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
    ):
        self.calls.append(
            dict(
                user_id=user_id,
                batch_size=batch_size,
                chunk_start_idx=chunk_start_idx,
                chunked=chunk_start_idx_tensor is not None,
            )
        )
        if get_last_token != -1 or last_token_slice is not None or last_token_index is not None:
            raise NotImplementedError(
                "the stand-in returns hidden states only (get_last_token=-1, no last-token slice)"
            )
        chunked = chunk_start_idx_tensor is not None
        expected_users = 0 if chunked or batch_size == 1 else list(range(batch_size))
        if user_id != expected_users:
            raise ValueError(f"user_id={user_id!r} for batch_size={batch_size}: expected {expected_users!r}")
        if chunked == (chunk_page_table is None):
            raise ValueError("chunk_page_table is the chunk's fill table: given exactly when chunk_start_idx_tensor is")
        rows = 1 if chunked else batch_size

        def body(x, cos, sin, page, chunk_page, start):
            tokens = self._token_ids(x).reshape(rows, -1)  # [B, S]
            start = torch.zeros(rows, dtype=torch.int64) if start is None else start.reshape(-1)
            self._check_rotary(cos, sin, int(start[0]), tokens.shape[1])
            fill, read = (chunk_page, page) if chunked else (page, None)
            read = None if read is None else read.to(torch.int32)
            hidden = self.llama.forward_hidden(tokens, start, fill.to(torch.int32), read, self.kv)  # [B, S, H]
            return hidden.reshape(1, 1, -1, hidden.shape[-1])

        inputs = [x_embed, *rot_mats, page_table, chunk_page_table, chunk_start_idx_tensor]
        return self._call("prefill_forward", body, inputs, self.tt.bfloat16)

    def _token_ids(self, x: torch.Tensor) -> torch.Tensor:
        """The ids whose embedding rows ``x [1, 1, N, H]`` holds exactly (anything else is a staging bug)."""
        rows = x.reshape(-1, x.shape[-1]).to(self.embedding.dtype)
        match = (rows[:, None, :] == self.embedding[None]).all(-1)  # [N, V]
        if not bool(match.any(-1).all()):
            raise ValueError("prefill_forward got activations that are not embedding rows")
        return match.to(torch.int8).argmax(-1)

    def _check_rotary(self, cos: torch.Tensor, sin: torch.Tensor, start: int, seq: int) -> None:
        last = self.cos.shape[0] - 1
        want = torch.arange(start, start + seq).clamp(max=last)
        if not (
            torch.equal(cos.reshape(seq, -1), self.cos[want]) and torch.equal(sin.reshape(seq, -1), self.sin[want])
        ):
            raise ValueError(f"rotary tables are not those of positions {start}..{start + seq - 1}")

    def post_process_prefill_output(self, hidden_states, last_token_idx, last_token_slice=None, last_token_index=None):
        first = last_token_idx // TILE * TILE

        def head(hidden):
            return self.llama.lm_head(hidden[0, 0, first : first + TILE].to(self.llama.dtype))[None, None]

        return self._call("post_process_prefill_output", head, [hidden_states], self.tt.float32)
