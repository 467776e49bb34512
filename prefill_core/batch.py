"""The caller's batch, stored by column: one entry per prompt, in the caller's order.

A batch carries geometry only (lengths, cached offsets, slots, page-table
rows) and sampling parameters, never token contents: the shell owns tokens,
the core owns geometry.

Why columns: a serving engine hands the runtime columns (a lengths vector,
a slots vector, a page-table matrix), and every row rule has a C-level
check over a whole column (``min``, ``max``, ``set``), so validating 32 rows
costs a few column passes instead of 32 object constructions and 32 rounds
of per-row checks. ``PrefillRow`` remains the one-prompt view, for callers
that think in rows and for naming the first broken rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import gt

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

COLUMNS = ("lengths", "cached", "slots", "blocks", "sampling")
_INT = {int}
_SAMPLING_TYPES = {type(None), SamplingParams}


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


def _check_row(index: int, row: PrefillRow) -> None:
    """Raises the first row-intrinsic rule ``row`` breaks (the slow, naming path)."""
    length, cached = row.length, row.cached
    if type(length) is not int or length <= 0:
        raise row_error(InvalidLengthError, index, "length", length, "must be an int > 0")
    if type(cached) is not int or not 0 <= cached <= length:
        raise row_error(InvalidCachedLengthError, index, "cached", cached, f"must be an int in [0, length={length}]")
    if type(row.slot) is not int or row.slot < 0:
        raise row_error(InvalidSlotError, index, "slot", row.slot, "must be an int >= 0")
    if not isinstance(row.blocks, tuple):
        raise row_error(InvalidPageTableError, index, "blocks", type(row.blocks).__name__, "must be a tuple of block ids")
    if row.blocks and set(map(type, row.blocks)) != _INT:
        column = next(j for j, b in enumerate(row.blocks) if type(b) is not int)
        raise row_error(InvalidPageTableError, index, f"blocks[{column}]", row.blocks[column], "block ids must be ints")
    if row.sampling is not None and not isinstance(row.sampling, SamplingParams):
        raise row_error(PrefillInputError, index, "sampling", row.sampling, "must be None or SamplingParams")


def _raise_first_row_rule(batch: PrefillBatch) -> None:
    seen: dict[int, int] = {}
    for index, row in enumerate(batch.rows):
        _check_row(index, row)
        first = seen.setdefault(row.slot, index)
        if first != index:
            raise row_error(InvalidSlotError, index, "slot", row.slot, f"slot already used by row {first}")
    raise AssertionError("a row rule failed on its column but no row breaks it")


def _check_shape(batch: PrefillBatch) -> int:
    for name in COLUMNS:
        if type(getattr(batch, name)) is not tuple:
            value = type(getattr(batch, name)).__name__
            raise PrefillInputError(f"PrefillBatch.{name}={value} is invalid: must be a tuple", field=name)
    n = len(batch.lengths)
    if n == 0:
        raise EmptyBatchError("PrefillBatch.rows=() is invalid: a batch needs at least one row", field="rows")
    for name in COLUMNS[1:]:
        if len(getattr(batch, name)) != n:
            rule = f"must hold one entry per row ({n} rows)"
            raise PrefillInputError(f"PrefillBatch.{name}=<{len(getattr(batch, name))} entries> is invalid: {rule}", field=name)
    return n


def _columns_pass(batch: PrefillBatch, n: int) -> bool:
    """Every row-intrinsic rule, as C-level passes over whole columns."""
    lengths, cached, slots, blocks = batch.lengths, batch.cached, batch.slots, batch.blocks
    # Types first: min/max below must only ever compare ints.
    if set(map(type, chain(lengths, cached, slots))) != _INT:
        return False
    if set(map(type, blocks)) != {tuple} or not set(map(type, batch.sampling)) <= _SAMPLING_TYPES:
        return False
    if not set(map(type, chain.from_iterable(blocks))) <= _INT:
        return False
    if min(lengths) <= 0 or min(chain(cached, slots)) < 0:
        return False
    if any(cached) and any(map(gt, cached, lengths)):  # nothing cached (the common wave): nothing to compare
        return False
    return len(set(slots)) == n


@attrs.frozen
class PrefillBatch:
    """The caller's prompts as columns, in the caller's order.

    Entry i of every column belongs to prompt i: ``lengths`` (tokens),
    ``cached`` (leading tokens already in the KV cache), ``slots`` (KV slot,
    unique per batch), ``blocks`` (the page-table row, see ``PrefillRow``)
    and ``sampling`` (``None`` asks for logits). Row-intrinsic rules are
    checked here; rules that need the layout or policy are checked by the
    planner.
    """

    lengths: tuple[int, ...]
    cached: tuple[int, ...]
    slots: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...] = attrs.field(repr=False)
    sampling: tuple[SamplingParams | None, ...]

    def __attrs_post_init__(self):
        n = _check_shape(self)
        if not _columns_pass(self, n):
            _raise_first_row_rule(self)

    @classmethod
    def from_rows(cls, rows: Sequence[PrefillRow]) -> PrefillBatch:
        """A batch of ``rows`` (a tuple or list of ``PrefillRow``), in order."""
        if not isinstance(rows, (tuple, list)):
            raise PrefillInputError(f"PrefillBatch rows={type(rows).__name__} is invalid: must be a tuple or list of PrefillRow", field="rows")
        for index, row in enumerate(rows):
            if not isinstance(row, PrefillRow):
                raise PrefillInputError(f"row {index}: expected a PrefillRow, got {type(row).__name__}", row=index, field="row")
        if not rows:
            return cls((), (), (), (), ())
        return cls(*zip(*((r.length, r.cached, r.slot, r.blocks, r.sampling) for r in rows)))

    def row(self, index: int) -> PrefillRow:
        return PrefillRow(self.lengths[index], self.cached[index], self.slots[index], self.blocks[index], self.sampling[index])

    @property
    def rows(self) -> tuple[PrefillRow, ...]:
        """Every prompt as a ``PrefillRow`` (built on access)."""
        return tuple(map(PrefillRow, self.lengths, self.cached, self.slots, self.blocks, self.sampling))

    def __len__(self) -> int:
        return len(self.lengths)
