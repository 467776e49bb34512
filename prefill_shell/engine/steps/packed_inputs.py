"""Host values of packed steps (``prefill_core.planning.packed``): one ``HostStep`` per ``PackedStep``.

Per step: the segments' tokens end to end, each token's absolute position,
the pool slot each token writes (``block * bs + position % bs`` through its
own row's page table, ``-1`` for a fully cached row's re-run), the segment
table ``(offset, length, start)`` and each segment's prefix table (its row's
blocks before ``start``, filler 0 past them). ``LAST_TOKEN_INDEX`` holds, on
the final step, each source row's last token as an index into the step's
tokens (zeros before it: non-final outputs are never read). A step with shared
writes (``prefill_core.planning.shared_spans``) also holds
``PACKED_SHARED_WRITES``: per shared position, the step token that computes it
and the taker's slot for it.
"""

from __future__ import annotations

import torch

from prefill_core import PackedRequest, PackedStep, RequestKind, ceil_div
from prefill_shell.device.contract import (
    LAST_TOKEN_INDEX,
    PACKED_POSITIONS,
    PACKED_PREFIX_TABLE,
    PACKED_SEGMENTS,
    PACKED_SHARED_WRITES,
    PACKED_TOKENS,
    PACKED_WRITE_SLOTS,
)
from prefill_shell.engine.steps.inputs import HostStep

__all__ = ["build_packed_host_steps"]


def _prefix_table(step: PackedStep, page_table: torch.Tensor, bs: int) -> torch.Tensor:
    widths = [ceil_div(segment.start, bs) for segment in step.segments]
    table = torch.zeros(len(widths), max(widths), dtype=torch.int32)
    for i, (segment, width) in enumerate(zip(step.segments, widths)):
        table[i, :width] = page_table[segment.row, :width]
    return table


def _shared_writes(step: PackedStep, page_table: torch.Tensor, bs: int) -> torch.Tensor:
    """``[N, 2]`` (token, slot): each shared position's index in the step's tokens, and the taker's slot for it."""
    offsets = {s.row: s.offset - s.start for s in step.segments}  # a row has one segment per step
    pairs = []
    for write in step.shared:
        span = torch.arange(write.start, write.end)
        blocks = page_table[write.row, span // bs].to(torch.int64)
        pairs.append(torch.stack([span + offsets[write.source], blocks * bs + span % bs], dim=1))
    return torch.cat(pairs)


def _host_step(
    tokens: torch.Tensor, page_table: torch.Tensor, step: PackedStep, index: int, bs: int, last: list[int]
) -> HostStep:
    ids, positions, slots = [], [], []
    for segment in step.segments:
        span = torch.arange(segment.start, segment.end)
        ids.append(tokens[segment.row, segment.start : segment.end])
        positions.append(span)
        if segment.writes:
            blocks = page_table[segment.row, span // bs].to(torch.int64)
            slots.append(blocks * bs + span % bs)
        else:
            slots.append(torch.full((segment.length,), -1, dtype=torch.int64))
    table = [(s.offset, s.length, s.start) for s in step.segments]
    values = {} if not step.shared else {PACKED_SHARED_WRITES: _shared_writes(step, page_table, bs)}
    values |= {
        PACKED_TOKENS: torch.cat(ids).to(torch.int64),
        PACKED_POSITIONS: torch.cat(positions),
        PACKED_WRITE_SLOTS: torch.cat(slots),
        PACKED_SEGMENTS: torch.tensor(table, dtype=torch.int64),
        PACKED_PREFIX_TABLE: _prefix_table(step, page_table, bs),
        LAST_TOKEN_INDEX: torch.tensor(last, dtype=torch.int64),
    }
    return HostStep(index, values, RequestKind.PACKED)


def build_packed_host_steps(tokens: torch.Tensor, request: PackedRequest, page_table: torch.Tensor) -> list[HostStep]:
    """Host values for every step of ``request``, in execution order (``page_table``: the caller's, by row)."""
    bs = request.block_size
    idle = [0] * request.active_batch_size
    final = list(request.last_token_offsets)
    return [
        _host_step(tokens, page_table, step, i, bs, final if i == request.num_chunks - 1 else idle)
        for i, step in enumerate(request.steps)
    ]
