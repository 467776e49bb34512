"""Host steps of a hybrid model's request: the padded step's values with one table set per KV group.

A padded hybrid step keeps the tokens, the chunk start, the slots and the last-token
index of ``inputs.build_host_steps`` and replaces the single fill and read
tables by ``contract.GROUPED_INPUTS``: each group's tables, first readable
columns and reused positions, exactly as ``prefill_core.GroupedRequest``
plans them (so an entry outside a window, whatever the caller's table held
there, is never staged). Groups' tables are padded to the widest group's
width (``body_geometry``'s ``Wgf`` / ``Wgr``) with -1 (fill) and the filler
0 (read), which no group reads. A packed hybrid step (``prefill_core.group_packed``)
holds its segments' tokens, positions and segment table as a packed step
does, and ``contract.GROUP_PACKED_TABLES`` in place of the single write
slots and prefix table: each group's slots, and each segment's prefix
blocks from its first column with ``(first column, count)`` beside them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefill_core import (
    SKIP,
    GroupedPackedRequest,
    GroupedRequest,
    RequestKind,
    prepare_grouped,
    prepare_grouped_packed,
)
from prefill_core.errors import PrefillInputError
from prefill_core.intmath import ceil_div
from prefill_core.plan import CHUNKED_FILLER
from prefill_shell.device.contract import (
    FILL_TABLE,
    GROUP_FILL_TABLES,
    GROUP_PREFIX_FROM,
    GROUP_PREFIX_TABLES,
    GROUP_READ_FROM,
    GROUP_READ_TABLES,
    GROUP_REUSED,
    GROUP_WRITE_SLOTS,
    LAST_TOKEN_INDEX,
    PACKED_POSITIONS,
    PACKED_SEGMENTS,
    PACKED_TOKENS,
    READ_TABLE,
    body_geometry,
)
from prefill_shell.engine.batch_builder import host_page_table
from prefill_shell.engine.steps.inputs import HostStep, build_host_steps

__all__ = ["GroupedPackedSteps", "GroupedSteps", "grouped_call"]


def _stacked(rows_per_group, width: int, filler: int) -> torch.Tensor:
    """``[G, B, width]`` int32 from each group's ``[B, w_g]`` rows, padded with ``filler``."""
    groups = [torch.tensor(rows, dtype=torch.int32) for rows in rows_per_group]
    return torch.stack([torch.constant_pad_nd(t, (0, width - t.shape[1]), filler) for t in groups])


class GroupedSteps(Sequence):
    """``base``'s host steps (``build_host_steps`` of the request), each with its groups' tables in place of its own."""

    def __init__(self, base: Sequence[HostStep], grouped: GroupedRequest, hidden_size: int):
        self.base, self.grouped = base, grouped
        signature = grouped.prepared.program_signature
        self._geometry = body_geometry(signature.body, hidden_size)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        step = self.base[index]
        values = {spec: value for spec, value in step.items() if spec not in (FILL_TABLE, READ_TABLE)}
        tables = self.grouped.step_tables(step.index)
        geometry = self._geometry
        values[GROUP_FILL_TABLES] = _stacked([t.fill for t in tables], geometry["Wgf"], SKIP)
        if geometry["Wgr"]:
            values[GROUP_READ_TABLES] = _stacked([t.read for t in tables], geometry["Wgr"], CHUNKED_FILLER)
        values[GROUP_READ_FROM] = torch.tensor([t.read_from for t in tables], dtype=torch.int32)
        values[GROUP_REUSED] = torch.tensor([t.reused for t in tables], dtype=torch.int32)
        return HostStep(step.index, values, step.kind)


class GroupedPackedSteps(Sequence):
    """The host steps of a packed hybrid request, built when read (``grouped`` names what each step writes)."""

    def __init__(self, matrix: torch.Tensor, grouped: GroupedPackedRequest):
        self.matrix, self.grouped = matrix, grouped

    def __len__(self) -> int:
        return self.grouped.request.num_chunks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        request = self.grouped.request
        index = range(len(self))[index]  # a negative index names a step from the end
        step = request.steps[index]
        tables = self.grouped.step_tables(index)
        counts = [[len(p) for p in t.prefix] for t in tables]
        prefix = torch.zeros(len(tables), len(step.segments), max(1, *(max(c) for c in counts)), dtype=torch.int32)
        for g, t in enumerate(tables):
            for i, blocks in enumerate(t.prefix):
                prefix[g, i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        final = index == request.num_chunks - 1
        last = list(request.last_token_offsets) if final else [0] * request.active_batch_size
        values = {
            PACKED_TOKENS: torch.cat([self.matrix[s.row, s.start : s.end] for s in step.segments]).to(torch.int64),
            PACKED_POSITIONS: torch.cat([torch.arange(s.start, s.end) for s in step.segments]),
            PACKED_SEGMENTS: torch.tensor([(s.offset, s.length, s.start) for s in step.segments], dtype=torch.int64),
            GROUP_WRITE_SLOTS: torch.tensor([t.write_slots for t in tables], dtype=torch.int64),
            GROUP_PREFIX_TABLES: prefix,
            GROUP_PREFIX_FROM: torch.tensor(
                [list(zip(t.prefix_from, c)) for t, c in zip(tables, counts)], dtype=torch.int64
            ),
            LAST_TOKEN_INDEX: torch.tensor(last, dtype=torch.int64),
        }
        return HostStep(index, values, RequestKind.PACKED)


def grouped_call(
    config, matrix: torch.Tensor, batch, group_page_tables, null_block: int | None, packed: bool = False
) -> tuple[tuple, tuple[Sequence[HostStep], ...]]:
    """Plans a hybrid model's call (``prefill_core.prepare_grouped``) and builds its host steps.

    ``group_page_tables[g]`` is group g's table (a ``[rows, width]`` tensor or
    nested lists, like ``page_table``); the batch was built from group 0's.
    ``packed``: plan packed steps where ``prepare_grouped_packed`` can (else padded waves).
    A model without an ``attention`` layout, or a call without the tables,
    is a ``PrefillInputError`` naming ``group_page_tables``.
    """
    attention = getattr(config.model, "attention", None)
    if attention is None or group_page_tables is None:
        why = "the model has no KV groups" if attention is None else "the model's KV groups need one table each"
        raise PrefillInputError(f"group_page_tables is invalid: {why}", field="group_page_tables")
    if not isinstance(group_page_tables, (list, tuple)) or len(group_page_tables) != len(attention.groups):
        msg = f"group_page_tables is invalid: must be a list of one table per KV group ({len(attention.groups)})"
        raise PrefillInputError(msg, field="group_page_tables")
    rows = len(batch)
    group_blocks = []
    for group, table in zip(attention.groups, group_page_tables):
        host = host_page_table(table, rows).tolist()
        need = [ceil_div(n, group.block_size) for n in batch.lengths]
        group_blocks.append(tuple(tuple(row[:n]) for row, n in zip(host, need)))
    args = (batch, config.policy, config.layout, attention, tuple(group_blocks))
    limits = {"null_block": null_block, "max_position": config.model.spec.max_position}
    packed_plan = prepare_grouped_packed(*args, **limits) if packed else None
    if packed_plan is not None:
        return tuple(g.prepared for g in packed_plan), tuple(GroupedPackedSteps(matrix, g) for g in packed_plan)
    planned = prepare_grouped(*args, **limits)
    hidden = config.model.spec.hidden_size
    steps = tuple(GroupedSteps(build_host_steps(matrix, g.request), g, hidden) for g in planned)
    return tuple(g.prepared for g in planned), steps
