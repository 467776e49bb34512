"""Host steps of a call, built by its plan's kind (``call_steps``), and a hybrid model's steps.

``call_steps`` is the one place a plan kind (``prefill_core.PlanKind``) meets
its host-step builder: padded waves (``inputs.build_host_steps``), packed
steps (``packed_inputs``), and the two hybrid kinds below.

A padded hybrid step keeps the tokens, the chunk start, the slots and the last-token
index of ``inputs.build_host_steps`` and replaces the single fill and read
tables by ``contract.GROUPED_INPUTS``: each group's tables, first readable
columns and reused positions, exactly as ``prefill_core.GroupedRequest``
plans them (so an entry outside a window, whatever the caller's table held
there, is never staged). Groups' tables are padded to the widest group's
width (``body_geometry``'s ``Wgf`` / ``Wgr``) with -1 (fill) and the filler
0 (read), which no group reads. A packed hybrid step (``prefill_core.kv_groups.group_packed``)
holds its segments' tokens, positions and segment table as a packed step
does, and ``contract.GROUP_PACKED_TABLES`` in place of the single write
slots and prefix table: each group's slots, and each segment's prefix
blocks from its first column with ``(first column, count)`` beside them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefill_core import SKIP, GroupedPackedRequest, GroupedRequest, RequestKind
from prefill_core.calls.call_plan import CallPlan, PlanKind
from prefill_core.planning.plan import CHUNKED_FILLER
from prefill_shell.device.contract import (
    CHUNK_START,
    FILL_TABLE,
    GROUP_FILL_TABLES,
    GROUP_PREFIX_FROM,
    GROUP_PREFIX_TABLES,
    GROUP_READ_FROM,
    GROUP_READ_TABLES,
    GROUP_REUSED,
    GROUP_WRITE_SLOTS,
    GROUPED_INPUTS,
    GROUPED_PACKED_INPUTS,
    INPUT_TOKENS,
    LAST_TOKEN_INDEX,
    PACKED_INPUTS,
    PACKED_POSITIONS,
    PACKED_SEGMENTS,
    PACKED_SHARED_WRITES,
    PACKED_TOKENS,
    READ_TABLE,
    body_geometry,
)
from prefill_shell.engine.steps.inputs import HostStep, build_host_steps
from prefill_shell.engine.steps.packed_inputs import build_packed_host_steps

__all__ = ["GroupedPackedSteps", "GroupedSteps", "body_call", "call_steps"]


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


def call_steps(plan: CallPlan, matrix: torch.Tensor, table: torch.Tensor, hidden_size: int) -> tuple:
    """Every request's host steps, by the plan's kind: the one place a request kind meets its step builder.

    ``matrix``: the caller's ``[rows, width]`` tokens; ``table``: its page
    table (the padded and packed kinds stage its rows; grouped kinds stage
    each group's, which the plan holds).
    """
    if plan.kind is PlanKind.GROUPED_PACKED:
        return tuple(GroupedPackedSteps(matrix, g) for g in plan.grouped)
    if plan.kind is PlanKind.GROUPED:
        return tuple(GroupedSteps(build_host_steps(matrix, g.request), g, hidden_size) for g in plan.grouped)
    if plan.kind is PlanKind.PACKED:
        return tuple(tuple(build_packed_host_steps(matrix, p.request, table)) for p in plan.prepared)
    return tuple(build_host_steps(matrix, p.request, table) for p in plan.prepared)


def body_call(step) -> tuple[str, list, dict]:
    """The model protocol method (``device.model``) a staged step of each kind runs, its arguments before the
    pool and its keyword options: the other half of ``call_steps``, so a step kind's builder and its model
    call sit together."""
    if step.kind is RequestKind.PACKED and GROUP_WRITE_SLOTS in step:  # a hybrid model's packed step
        return "forward_packed_grouped", [step[spec].value for spec in GROUPED_PACKED_INPUTS], {}
    if step.kind is RequestKind.PACKED:  # segments end to end (prefill_core.planning.packed)
        shared = step.get(PACKED_SHARED_WRITES)  # only a model with the capability gets plans that have them
        options = {} if shared is None else {"shared_writes": shared.value}
        return "forward_packed", [step[spec].value for spec in PACKED_INPUTS], options
    if GROUP_FILL_TABLES in step:  # a hybrid model's padded step: each KV group's tables
        tables = [None if spec not in step else step[spec].value for spec in GROUPED_INPUTS]
        return "forward_grouped", [step[INPUT_TOKENS].value, step[CHUNK_START].value, *tables], {}
    read = step.get(READ_TABLE)
    tables = [step[FILL_TABLE].value, None if read is None else read.value]
    return "forward_hidden", [step[INPUT_TOKENS].value, step[CHUNK_START].value, *tables], {}
