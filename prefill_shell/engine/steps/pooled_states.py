"""Pooled hidden states: one more kind of call output, each row's final hidden states pooled LAST, MEAN or CLS.

A call asks with ``PrefillCall.pooling`` (one ``prefill_core.values.pooling.PoolingType``
or ``None`` per caller row). At prepare time ``pooled_states`` decides, on
the host, which rows of which step's hidden output feed each pooled row: the
core's rule (``pooled_positions``) over the steps' segments
(``request.segments(i)``: a padded wave's row ``b`` at ``b * S`` of the
flattened output, a packed step's segments end to end). In the step loop the
hook reads each step's hidden output, eager or replayed, before the next step
overwrites it, and copies what it keeps: a LAST or CLS row one float32
vector, a MEAN row a float32 sum and a count (the mean is taken once, after
its last step, so a row split over chunks or packed requests pools as one
pass would). ``PrefillResult.pooled`` then holds the row's float32
``[hidden]`` vector. The heads (truncation, normalisation, a classification
layer) are the pooling clients' (``prefill_shell.pooling``, the serving
facade), from ``engine.pooled_heads``.

The hidden output must be a torch tensor (the torch backend, eager or
traced); another backend's is refused by name.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from prefill_core.values.errors import PrefillInputError
from prefill_core.values.pooling import PoolingType, pooled_positions
from prefill_shell.engine.steps.inputs import HostStep

__all__ = ["PooledStates", "RowPool", "pooled_states", "with_pooled"]


class RowPool:
    """One row's pooled state, fed position runs of hidden states in position order."""

    def __init__(self, pooling_type: PoolingType):
        self.pooling_type = pooling_type
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._vector: torch.Tensor | None = None

    def add(self, hidden: torch.Tensor) -> None:
        """``hidden [n, H]``: the states of positions this pool needs (``pooled_positions``)."""
        if self.pooling_type is PoolingType.MEAN:
            part = hidden.float().sum(dim=0)
            self._sum = part if self._sum is None else self._sum + part
            self._count += hidden.shape[0]
        elif self.pooling_type is PoolingType.LAST:
            self._vector = hidden[-1].to(torch.float32, copy=True)  # a copy: a replay overwrites its workspace
        elif self._vector is None:  # CLS: the first position fed, position 0
            self._vector = hidden[0].to(torch.float32, copy=True)

    def result(self) -> torch.Tensor:
        """The pooled float32 vector ``[H]``."""
        if self.pooling_type is PoolingType.MEAN:
            if self._sum is None:
                raise RuntimeError("a MEAN pool was read before any position was added")
            return self._sum / self._count
        if self._vector is None:
            raise RuntimeError(f"a {self.pooling_type.value} pool was read before its position was added")
        return self._vector


class _Pick(NamedTuple):
    row: int
    first: int  # rows of the step's flattened hidden output
    end: int


class PooledStates:
    """A prepared call's pooled rows: the picks of each (request, step) and each row's running pool."""

    def __init__(
        self,
        picks: dict[tuple[int, int], list[_Pick]],
        types: dict[int, PoolingType],
        ends: frozenset[int] = frozenset(),
    ):
        self._picks = picks
        self._types = types
        self._ends = ends
        self._pools: dict[int, RowPool] = {}
        self.start()

    def start(self) -> None:
        """Fresh pools for a run of the call (running it again pools again, not twice)."""
        self._pools = {row: RowPool(t) for row, t in self._types.items()}

    def hook(self, request: int):
        """The step loop's ``on_hidden(hidden, step)`` for request ``request``; None when it pools nothing."""
        if not any(r == request for r, _ in self._picks):
            return None

        def on_hidden(hidden: Any, step: int) -> None:
            todo = self._picks.get((request, step))
            if not todo:
                return
            if not isinstance(hidden, torch.Tensor):
                raise TypeError(f"pooling reads the hidden output as a torch tensor, not {type(hidden).__name__}")
            flat = hidden.reshape(-1, hidden.shape[-1])
            for pick in todo:
                self._pools[pick.row].add(flat[pick.first : pick.end])

        return on_hidden

    def reads_ends_only(self, request: int) -> bool:
        """Whether every hidden row request ``request`` pools is the last token of its step's segment (LAST
        pooling, each row's last token): then a packed step may compute its segment ends alone
        (``device.model.SEGMENT_ENDS_CAPABILITY``)."""
        return request in self._ends

    def result(self, row: int) -> torch.Tensor | None:
        """Caller row ``row``'s pooled float32 vector, or None where the row asked for none."""
        pool = self._pools.get(row)
        return None if pool is None else pool.result()


def _types(pooling: Sequence[PoolingType | None], num_rows: int) -> dict[int, PoolingType]:
    if isinstance(pooling, (str, bytes)) or not isinstance(pooling, Sequence) or len(pooling) != num_rows:
        msg = f"pooling={pooling!r} is invalid: one PoolingType or None per row ({num_rows} rows)"
        raise PrefillInputError(msg, field="pooling")
    out = {}
    for row, kind in enumerate(pooling):
        if kind is not None and not isinstance(kind, PoolingType):
            msg = f"row {row}: pooling={kind!r} is invalid: a PoolingType or None"
            raise PrefillInputError(msg, row=row, field="pooling")
        if kind is not None:
            out[row] = kind
    return out


def pooled_states(
    requests: Sequence, steps: Sequence[Sequence[HostStep]], pooling: Sequence[PoolingType | None], num_rows: int
) -> PooledStates:
    """Which hidden rows of which step feed each pooled caller row (a ``PoolingPrefixError`` if one is missing)."""
    types = _types(pooling, num_rows)
    runs: dict[int, list[tuple[int, int, tuple[int, int, Any]]]] = defaultdict(list)
    for r, (prepared, request_steps) in enumerate(zip(requests, steps)):
        for position, step in enumerate(request_steps):  # the step loop's on_hidden counts steps this way
            for seg in prepared.request.segments(step.index):
                if seg.row in types:
                    runs[seg.row].append((seg.start, seg.length, (r, position, seg)))
    picks: dict[tuple[int, int], list[_Pick]] = defaultdict(list)
    beyond_ends: set[int] = set()  # requests with a pooled row that is not the last token of its segment
    for row, row_runs in runs.items():
        row_runs.sort(key=lambda run: (run[2][0], run[2][1]))  # plan order is position order for one row
        length = max(start + n for start, n, _ in row_runs)
        try:
            chosen = pooled_positions(types[row], length, [(start, n) for start, n, _ in row_runs])
        except PrefillInputError as error:
            raise type(error)(f"row {row}: {error}", row=row, field=error.field) from None
        for index, first, end in chosen:
            r, s, seg = row_runs[index][2]
            offset = seg.offset - seg.start
            picks[(r, s)].append(_Pick(row, offset + first, offset + end))
            if (first, end) != (seg.start + seg.length - 1, seg.start + seg.length):
                beyond_ends.add(r)
    ends = frozenset(r for r, _ in picks) - beyond_ends
    return PooledStates(dict(picks), types, ends)


def with_pooled(batch, results: list) -> list:
    """``results`` (one ``PrefillResult`` per caller row of ``batch``, in its row order) with their pooled vectors."""
    pooled = getattr(batch, "pooled", None)
    if pooled is None:
        return results
    return [result._replace(pooled=pooled.result(row)) for row, result in enumerate(results)]
