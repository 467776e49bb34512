"""The one runtime-facing piece of pooling: the hidden output of each step in, each row's pooled vector out.

``pooled_call`` runs one planned call (``PrefillRuntime.prepare``) through
the runtime's invocations with a hidden-state hook, and returns the call's
per-row results (last-token logits, as always) beside each row's pooled
float32 vector. Which positions of which step feed a row is the core's
rule (``prefill_core.values.pooling.pooled_positions``) over the steps' segments
(``request.segments(i)``: a padded wave's row ``b`` at ``b * S`` of the
flattened hidden output, a packed step's segments end to end), decided on
the host before anything runs. A packed row may start in one request's
steps and end in a later one's: its pool lives across requests.

The hook reads the hidden output while the step loop still owns it (before
the next step or replay overwrites it) and copies what it keeps, so traced
replays pool as eager steps do. It needs the hidden output as a torch
tensor (the torch backend, eager or traced); a backend whose hidden output
is another type is refused by name.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from prefill_core.values.pooling import PoolingType, pooled_positions
from prefill_shell.pooling.heads import RowPool

__all__ = ["PooledCall", "pooled_call", "pooling_picks"]


class _Pick(NamedTuple):
    row: int
    first: int  # rows of the step's flattened hidden output
    end: int


class PooledCall(NamedTuple):
    results: list  # PrefillResult per caller row
    pooled: torch.Tensor  # float32 [rows, hidden]


def pooling_picks(batch, types: Sequence[PoolingType]) -> dict[tuple[int, int], list[_Pick]]:
    """``{(request, step): picks}``: the hidden rows each step contributes to each caller row's pool."""
    runs: dict[int, list[tuple[int, int, Any]]] = defaultdict(list)  # row -> (start, length, (request, step, seg))
    for r, (prepared, steps) in enumerate(zip(batch.requests, batch.steps)):
        for position, step in enumerate(steps):  # the step loop's on_hidden counts steps this way
            for seg in prepared.request.segments(step.index):
                runs[seg.row].append((seg.start, seg.length, (r, position, seg)))
    picks: dict[tuple[int, int], list[_Pick]] = defaultdict(list)
    for row, row_runs in runs.items():
        row_runs.sort(key=lambda run: (run[2][0], run[2][1]))  # plan order is position order for one row
        length = max(start + n for start, n, _ in row_runs)
        chosen = pooled_positions(types[row], length, [(start, n) for start, n, _ in row_runs])
        for index, first, end in chosen:
            _, _, (r, s, seg) = row_runs[index]
            offset = seg.offset - seg.start
            picks[(r, s)].append(_Pick(row, offset + first, offset + end))
    return picks


def pooled_call(runtime, batch, types: Sequence[PoolingType], *, mode="auto", on_progress=None) -> PooledCall:
    """Runs ``batch`` (prepared by ``runtime``) and pools each caller row's positions as ``types[row]`` says."""
    picks = pooling_picks(batch, types)
    pools = [RowPool(t) for t in types]

    def on_hidden(request: int, hidden: Any, step: int) -> None:
        todo = picks.get((request, step))
        if not todo:
            return
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"pooling reads the hidden output as a torch tensor, not {type(hidden).__name__}")
        flat = hidden.reshape(-1, hidden.shape[-1])
        for pick in todo:
            pools[pick.row].add(flat[pick.first : pick.end])

    invocations = runtime.invocations(batch, mode=mode, on_progress=on_progress, on_hidden=on_hidden)
    results = runtime.assemble(invocations, batch.num_rows)
    pooled = torch.stack([pool.result() for pool in pools]) if pools else torch.empty(0)
    return PooledCall(results, pooled)
