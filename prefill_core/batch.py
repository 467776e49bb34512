"""The caller's batch: one ``PrefillRow`` per prompt, in the caller's order.

A row carries geometry only (lengths, slot, the page-table row), never token
contents: the shell owns tokens, the core owns geometry.
"""

from __future__ import annotations

import attrs

from .errors import (
    EmptyBatchError,
    InvalidCachedLengthError,
    InvalidLengthError,
    InvalidPageTableError,
    InvalidSlotError,
    PrefillInputError,
    row_error,
)
from .sampling import SamplingParams

__all__ = ["PrefillRow", "PrefillBatch"]


@attrs.frozen
class PrefillRow:
    """One prompt.

    ``length`` tokens, of which the first ``cached`` already sit in the KV
    cache; ``slot`` is the row's KV slot (its user id in the lane);
    ``blocks`` is the caller's page-table row: entry j is the KV block holding
    positions ``[j*block_size, (j+1)*block_size)``. Only the mapped prefix,
    the first ``ceil(length / block_size)`` entries, is read; a longer row's
    tail (vLLM's stale entries) is ignored, never copied to the device.
    """

    length: int
    cached: int = 0
    slot: int = 0
    blocks: tuple[int, ...] = ()
    sampling: SamplingParams | None = None


def _check_row(index: int, row: object) -> None:
    if not isinstance(row, PrefillRow):
        raise PrefillInputError(f"row {index}: expected a PrefillRow, got {type(row).__name__}", row=index, field="row")
    length, cached = row.length, row.cached
    if type(length) is not int or length <= 0:
        raise row_error(InvalidLengthError, index, "length", length, "must be an int > 0")
    if type(cached) is not int or not 0 <= cached <= length:
        raise row_error(InvalidCachedLengthError, index, "cached", cached, f"must be an int in [0, length={length}]")
    if type(row.slot) is not int or row.slot < 0:
        raise row_error(InvalidSlotError, index, "slot", row.slot, "must be an int >= 0")
    if not isinstance(row.blocks, tuple):
        raise row_error(InvalidPageTableError, index, "blocks", type(row.blocks).__name__, "must be a tuple of block ids")
    if row.blocks and set(map(type, row.blocks)) != {int}:
        column = next(j for j, b in enumerate(row.blocks) if type(b) is not int)
        raise row_error(InvalidPageTableError, index, f"blocks[{column}]", row.blocks[column], "block ids must be ints")
    if row.sampling is not None and not isinstance(row.sampling, SamplingParams):
        raise row_error(PrefillInputError, index, "sampling", row.sampling, "must be None or SamplingParams")


def _check_rows(instance, attribute, rows) -> None:
    if not isinstance(rows, tuple):
        raise PrefillInputError(f"PrefillBatch.rows must be a tuple, got {type(rows).__name__}", field="rows")
    if not rows:
        raise EmptyBatchError("PrefillBatch.rows=() is invalid: a batch needs at least one row", field="rows")
    seen: dict[int, int] = {}
    for index, row in enumerate(rows):
        _check_row(index, row)
        first = seen.setdefault(row.slot, index)
        if first != index:
            rule = f"slot already used by row {first}"
            raise row_error(InvalidSlotError, index, "slot", row.slot, rule)


@attrs.frozen
class PrefillBatch:
    """The caller's rows, in the caller's order. Row-intrinsic rules are checked here;
    rules that need the layout or policy are checked by the planner."""

    rows: tuple[PrefillRow, ...] = attrs.field(validator=_check_rows)

    def __len__(self) -> int:
        return len(self.rows)
