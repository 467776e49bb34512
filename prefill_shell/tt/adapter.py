"""``TtModelAdapter``: a tt-metal TTTv2 prefill model (``TtModel``) behind the runtime's model protocol.

Targets the model protocol that tt-metal's common prefill runtime drives:
``models/common/llm_runtime/prefill/runtime.py`` at commit
``0277e5a6f0eaf2518ea4001a43e0d4cf19aa743e`` (its ``_run_hidden_body`` and
``_run_chunk_hidden_body``) and the rotary staging of
``models/common/llm_runtime/prefill/inputs.py`` at commit
``8d0a02eb5d231e45d6c467856c541d605c06cae8`` (``prepare_prefill_rot_mats``
on device position indices, uint32 ROW_MAJOR ``[1, S]``). The runtime calls
``forward_hidden(tokens, start, fill_table, read_table, kv)`` and
``lm_head(rows)`` with tensors staged by ``TtnnBackend``; the adapter turns
each into exactly the calls that runtime makes:

* tokens uint32 ``[1, 1, B, S]`` -> ``embed_prefill(tokens [1, 1, 1, B*S])``
  (a row-major reshape is a view; tt-metal's runtime stages the same form).
* positions: ``arange(S)`` on device, plus ``start`` for a chunk (a tensor:
  a trace reads it at replay), clamped to ``spec.max_position - 1`` (int32
  ``ttnn.clamp`` with scalar bounds, the form ttnn documents for INT32),
  typecast to uint32 ``[1, S]`` -> ``prepare_prefill_rot_mats(positions)``
  -> ``[rotary_cos, rotary_sin]``. tt-metal's runtime clamps the same
  positions on the host (``prepare_host_inputs`` in ``inputs.py``:
  ``arange(start, start + S).clamp(max=matrix_length - 1)``): the padding
  tail of a final chunk can run past the table (a 8192-token row cached 64
  has its last 2048-token chunk at 6208..8255), and a TTTv2 model gathers
  the rows with ``ttnn.embedding``, which does not bound its ids. The
  adapter assumes the model's rotary table holds ``spec.max_position`` rows.
* regular prefill (no read table): ``prefill_forward(x, [cos, sin],
  user_id=list(range(B)) if B > 1 else 0, page_table=fill_table,
  chunk_page_table=None, get_last_token=-1, batch_size=B,
  chunk_start_idx_tensor=None)``. Padding rows are in ``user_id`` too: their
  fill-table rows are all -1, so they write nothing.
* chunked prefill: ``prefill_forward(x, [cos, sin], user_id=0,
  page_table=read_table, chunk_page_table=fill_table, chunk_start_idx=None,
  get_last_token=-1, chunk_start_idx_tensor=start, last_token_slice=None,
  last_token_index=None)``: that runtime's traced chunk body, used eagerly
  too, because its eager form (``chunk_start_idx=<int>`` with a
  last-token slice) bakes the position into the program.
* ``lm_head(rows [1, 1, B, H])``: rows padded to one 32-row tile ->
  ``post_process_prefill_output(tile, 0)`` (final norm and LM head) -> the
  first B rows of its logits. With ``get_last_token=-1`` a TTTv2 model
  returns the hidden states before the final norm, so this adapter's
  ``forward_hidden`` does too; the norm is per row, so normalising the
  gathered rows gives the same logits.

Hybrid models (``attention=`` an ``AttentionLayout``: KV groups with their
own windows and block sizes): the runtime hands each padded step's
``contract.GROUPED_INPUTS`` to ``forward_grouped``, which makes the same
embed and rotary calls and one ``prefill_forward`` whose single-table slots
are ``None`` (no layer can be given one table for every group) and whose
tables come by the contract's names, as staged (int32 ``[K, B, W]``, group
g's table off the leading dimension): ``group_fill_tables``,
``group_read_tables`` (``None`` for a regular step), ``group_read_from``,
``group_reused``, plus ``kv_groups`` (the layout's ``KVGroup`` values, host
constants: each group's layers, window and block size; a layer passes its
group's window to ``chunked_scaled_dot_product_attention``, see
``window_attention.py``). vLLM's plugin sends one table per layer
(``page_tables_per_layer``); here a layer slices its group's, and
``kv_groups`` says which group a layer is in. Chunked hybrid steps run one
row, like other chunked steps.
Only a model declaring ``group_tables = True`` is given them: any other is
refused by name when the adapter is built with a layout.

The KV pool is bound inside a TTTv2 model (``set_kv_cache``), so ``kv`` is
only the geometry the runtime config checks (``TtKVCache``).

A stock tt_transformers ``Transformer`` (``models/tt_transformers/tt/model.py``,
commit ``00a9ba8f2518e39005cfcab65592639859b03eb9``) is not adapted:
its ``ttnn_prefill_forward(x, rot_mats_global, rot_mats_local, user_id,
page_table, chunk_page_table, chunk_start_idx, get_last_token, kv_cache)``
takes no ``batch_size`` (no batched waves) and the chunk start only as a
host int, so a trace would bake it in: one trace per chunk position, and an
eager chunk would need a host read of the device ``start``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from prefill_core import AttentionLayout
from prefill_core.values.errors import PrefillConfigError
from prefill_shell.device.model import ModelSpec
from prefill_shell.tt import staging as ttnn_staging

__all__ = ["GROUP_TABLES_CAPABILITY", "TILE_ROWS", "TtHybridModel", "TtKVCache", "TtModel", "TtModelAdapter"]

GROUP_TABLES_CAPABILITY = "group_tables"
"""A ``TtModel`` with ``group_tables = True`` takes a hybrid step's per-group tables (see the module doc)."""

TILE_ROWS = 32
"""Rows of one tile: ``post_process_prefill_output`` norms and projects one tile of rows."""


@runtime_checkable
class TtModel(Protocol):
    """What the adapter calls on a TTTv2 prefill model (the calls tt-metal's prefill runtime makes, exactly)."""

    def embed_prefill(self, tokens: Any) -> Any:
        """uint32 ``[1, 1, 1, B*S]`` ids -> embeddings ``[1, 1, B*S, H]``."""

    def prepare_prefill_rot_mats(self, position_indices: Any) -> tuple[Any, Any]:
        """uint32 ``[1, S]`` positions -> ``(cos, sin)`` rotary tables for them."""

    def prefill_forward(
        self,
        x_embed: Any,
        rot_mats: Any,
        user_id: Any = 0,
        page_table: Any = None,
        chunk_page_table: Any = None,
        chunk_start_idx: int | None = None,
        get_last_token: int = -1,
        batch_size: int = 1,
        chunk_start_idx_tensor: Any = None,
        last_token_slice: Any = None,
        last_token_index: Any = None,
    ) -> Any:
        """One prefill body; with ``get_last_token=-1`` the hidden states ``[1, 1, B*S, H]`` before the final norm."""

    def post_process_prefill_output(
        self, hidden_states: Any, last_token_idx: int, last_token_slice: Any = None, last_token_index: Any = None
    ) -> Any:
        """Final norm and LM head of the 32-row tile holding ``last_token_idx`` -> logits ``[1, 1, 32, V]``."""


@runtime_checkable
class TtHybridModel(TtModel, Protocol):
    """A hybrid checkpoint's ``TtModel``: ``group_tables = True``; ``prefill_forward`` takes each KV group's tables.

    The group keywords are ``contract.GROUPED_INPUTS`` as staged (int32 ROW_MAJOR ``[K, B, W]``, ``group_reused``
    ``[K, B, 2]``) and ``kv_groups``, the ``AttentionLayout``'s groups; ``page_table`` and ``chunk_page_table``
    are then ``None``, and ``group_read_tables`` is given exactly for a chunked step.
    """

    group_tables: bool

    def prefill_forward(
        self,
        x_embed: Any,
        rot_mats: Any,
        user_id: Any = 0,
        page_table: Any = None,
        chunk_page_table: Any = None,
        chunk_start_idx: int | None = None,
        get_last_token: int = -1,
        batch_size: int = 1,
        chunk_start_idx_tensor: Any = None,
        last_token_slice: Any = None,
        last_token_index: Any = None,
        group_fill_tables: Any = None,
        group_read_tables: Any = None,
        group_read_from: Any = None,
        group_reused: Any = None,
        kv_groups: Any = None,
    ) -> Any:
        """``TtModel.prefill_forward`` with each group's tables: layer l reads and writes group g's ``[g]`` rows."""


class TtKVCache:
    """The geometry of a paged KV pool bound inside a ttnn model (``block_size``, ``num_blocks``)."""

    def __init__(self, block_size: int, num_blocks: int, layers: list | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layers = layers or []


class TtModelAdapter:
    """Implements ``PrefillModel`` over a ``TtModel`` (see the module doc for the exact calls)."""

    dtype = torch.bfloat16
    """Host dtype of hidden buffers the runtime sizes; the device form is bfloat16 TILE regardless."""

    def __init__(
        self,
        tt_model: TtModel,
        spec: ModelSpec,
        *,
        mesh_device: Any,
        ttnn_module: Any = None,
        attention: AttentionLayout | None = None,
    ):
        if ttnn_module is None:
            ttnn_module = ttnn_staging.import_ttnn()
        if not isinstance(tt_model, TtModel):
            raise TypeError(
                f"{type(tt_model).__name__} does not implement TtModel (embed_prefill, "
                "prepare_prefill_rot_mats, prefill_forward, post_process_prefill_output)"
            )
        if attention is not None and getattr(tt_model, GROUP_TABLES_CAPABILITY, False) is not True:
            msg = (
                f"{type(tt_model).__name__} does not declare {GROUP_TABLES_CAPABILITY} = True: a hybrid model's "
                f"{len(attention.groups)} KV groups each need their own tables, not one page_table"
            )
            raise PrefillConfigError(msg)
        if attention is not None and attention.num_layers != spec.num_layers:
            raise PrefillConfigError(f"attention has {attention.num_layers} layers, the spec {spec.num_layers}")
        self.attention = attention
        self.tt = ttnn_module
        self.model = tt_model
        self.spec = spec
        self.mesh = mesh_device

    def with_attention(self, attention: AttentionLayout) -> TtModelAdapter:
        """The same TTTv2 model behind a new layout: the KV groups vLLM formed (``HybridServingFacade`` at
        allocation), which each step hands to the model as ``kv_groups``."""
        return TtModelAdapter(self.model, self.spec, mesh_device=self.mesh, ttnn_module=self.tt, attention=attention)

    def positions(self, start: Any, seq_len: int, chunked: bool) -> Any:
        """uint32 ROW_MAJOR ``[1, S]``: ``start .. start+S-1`` clamped to ``max_position - 1`` (regular starts at 0)."""
        tt = self.tt
        ramp = tt.arange(0, seq_len, 1, dtype=tt.int32, device=self.mesh)
        ramp = tt.to_layout(tt.reshape(ramp, (1, seq_len)), tt.TILE_LAYOUT)
        if chunked:
            offset = tt.to_layout(tt.reshape(start, (1, 1)), tt.TILE_LAYOUT)
            ramp = tt.add(ramp, offset)  # broadcast over the row
        # Padding positions of a final chunk (or of a padded wave) may run past
        # the rotary table, which ``prepare_prefill_rot_mats`` indexes with
        # ``ttnn.embedding``: clamp them to its last row, as tt-metal's runtime
        # does on the host. Real tokens never reach the clamp (``max_position``).
        ramp = tt.clamp(ramp, min=0, max=self.spec.max_position - 1)
        return tt.typecast(tt.to_layout(ramp, tt.ROW_MAJOR_LAYOUT), tt.uint32)

    def _embedded(self, tokens: Any, start: Any, chunked: bool) -> tuple[int, Any, list]:
        """``(B, embeddings, [cos, sin])`` of one step; a chunked wave of several rows is refused."""
        tt, model = self.tt, self.model
        b, s = int(tokens.shape[-2]), int(tokens.shape[-1])
        if chunked and b > 1:
            # TTTv2's chunked prefill_forward takes one user (user_id=0) and one chunk start per call.
            msg = f"a chunked wave of {b} rows: the TTTv2 chunked body runs one row; plan with batch_cached_rows=False"
            raise ValueError(msg)
        x = model.embed_prefill(tt.reshape(tokens, (1, 1, 1, b * s)))
        cos, sin = model.prepare_prefill_rot_mats(self.positions(start, s, chunked=chunked))
        return b, x, [cos, sin]

    def _body(self, x: Any, rot_mats: list, b: int, start: Any, page: Any, chunk_page: Any, chunked: bool, **groups):
        """The runtime's regular or chunked ``prefill_forward`` call (module doc), ``groups`` keywords added."""
        if not chunked:
            users = list(range(b)) if b > 1 else 0
            return self.model.prefill_forward(
                x,
                rot_mats,
                user_id=users,
                page_table=page,
                chunk_page_table=None,
                get_last_token=-1,
                batch_size=b,
                chunk_start_idx_tensor=None,
                **groups,
            )
        return self.model.prefill_forward(
            x,
            rot_mats,
            user_id=0,
            page_table=page,
            chunk_page_table=chunk_page,
            chunk_start_idx=None,
            get_last_token=-1,
            chunk_start_idx_tensor=start,
            last_token_slice=None,
            last_token_index=None,
            **groups,
        )

    def forward_hidden(self, tokens: Any, start: Any, fill_table: Any, read_table: Any, kv: Any) -> Any:
        """One chunk: hidden states ``[1, 1, B*S, H]`` before the final norm (see the module doc)."""
        if self.attention is not None:
            raise PrefillConfigError("a hybrid model reads one table per KV group: pass group_page_tables to prepare")
        chunked = read_table is not None
        b, x, rot_mats = self._embedded(tokens, start, chunked)
        if not chunked:
            return self._body(x, rot_mats, b, start, fill_table, None, chunked)
        return self._body(x, rot_mats, b, start, read_table, fill_table, chunked)

    def forward_grouped(
        self, tokens: Any, start: Any, fill_tables: Any, read_tables: Any, read_from: Any, reused: Any, kv: Any
    ) -> Any:
        """One padded hybrid step (``contract.GROUPED_INPUTS``): hidden ``[1, 1, B*S, H]`` (see the module doc)."""
        if self.attention is None:
            raise PrefillConfigError("this adapter was built without an attention layout: it runs no KV groups")
        chunked = read_tables is not None
        b, x, rot_mats = self._embedded(tokens, start, chunked)
        groups = dict(
            group_fill_tables=fill_tables,
            group_read_tables=read_tables,
            group_read_from=read_from,
            group_reused=reused,
            kv_groups=self.attention.groups,
        )
        return self._body(x, rot_mats, b, start, None, None, chunked, **groups)

    def lm_head(self, hidden_rows: Any) -> Any:
        """``[1, 1, B, H]`` gathered rows -> logits ``[1, 1, B, V]`` through ``post_process_prefill_output``."""
        tt = self.tt
        b = int(hidden_rows.shape[-2])
        tile = hidden_rows
        if b < TILE_ROWS:
            tile = tt.pad(hidden_rows, [(0, 0), (0, 0), (0, TILE_ROWS - b), (0, 0)], 0.0)
        logits = self.model.post_process_prefill_output(tile, 0)
        if b == TILE_ROWS:
            return logits
        return tt.slice(logits, (0, 0, 0, 0), (1, 1, b, int(logits.shape[-1])), (1, 1, 1, 1))
