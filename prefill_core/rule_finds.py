"""How each input rule finds the first row that breaks it (``rules.RULES`` names them).

Every function here takes a ``Scope`` (the batch, plus the layout and policy
limits in the plan stage) and returns the first ``Hit`` in caller row order,
or ``None``. A function may first ask a cheap whole-column question whose
answer ``no`` proves no row breaks its rule (``min``, ``set``); when the
answer is ``maybe`` the same function walks the rows. Each function is the
only place its rule is written.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from functools import cached_property
from itertools import chain, repeat
from operator import ge, gt, indexOf, is_, lt, mod, truth

import attrs

from .intmath import ceil_div_column
from .sampling import SamplingParams

COLUMNS = ("lengths", "cached", "slots", "blocks", "sampling")
_INT = {int}
_SAMPLING_TYPES = {type(None), SamplingParams}


@attrs.frozen
class Hit:
    """Where a rule broke: the row (``None`` for the batch), the field, the value, extra words."""

    row: int | None
    field: str
    value: object
    detail: str = ""
    shown: str | None = None  # a summary shown instead of ``repr(value)`` (long tuples, types)


@attrs.frozen
class Limits:
    """The layout and policy numbers the plan-stage rules judge rows against."""

    block_size: int
    num_blocks: int
    capacity: int
    lane_size: int
    max_logprobs: int
    max_position: int | None


class Scope:
    """A batch under judgement, with the derived columns several rules read (each built once).

    The ``batch`` stage judges the rows alone and derives nothing. With
    ``limits`` (the ``plan`` stage, whose batch has passed the ``batch``
    rules: ints and tuples throughout) the columns every plan rule of a
    passing batch reads are built here at once:

    * ``longest``: the longest row's length;
    * ``needs``: each row's mapped block count, ``ceil(length / block_size)``;
    * ``widths``: how many page-table entries each row passed;
    * ``prefixes``: each row's mapped prefix (a row cut to its prefix, as
      the shell passes it, is itself; a short row is all it has);
    * ``mapped_ids``: every mapped block id, row after row, repeats kept (a
      sequence, bounded and hashed in C passes linear in the ids, whatever
      their order);
    * ``has_repeats``: whether any id appears twice (else no repeat rule can fire);
    * ``distinct_sampling``: ``(first row, params)`` for each distinct
      parameter object (rows usually share a few).
    """

    def __init__(self, batch, limits: Limits | None = None):
        self.batch = batch
        self.limits = limits
        if limits is None:
            return
        lengths, blocks = batch.lengths, batch.blocks
        self.longest = max(lengths)
        self.needs = needs = ceil_div_column(lengths, limits.block_size)
        self.widths = widths = list(map(len, blocks))
        self.prefixes = blocks if widths == needs else list(map(tuple.__getitem__, blocks, map(slice, needs)))
        prefixes = self.prefixes
        self.mapped_ids = prefixes[0] if len(prefixes) == 1 else list(chain.from_iterable(prefixes))
        self.has_repeats = len(set(self.mapped_ids)) != len(self.mapped_ids)
        self.distinct_sampling = _distinct_sampling(batch.sampling)

    @cached_property
    def first_written(self) -> list[int]:
        """Each row's first written column, ``cached // block_size``."""
        bs = self.limits.block_size
        return [c // bs for c in self.batch.cached]


def _distinct_sampling(sampling: tuple) -> list[tuple[int, SamplingParams]]:
    """``(first row, params)`` for each distinct parameter object in ``sampling``, None excluded."""
    if all(map(is_, sampling, repeat(sampling[0]))):  # one object for every row (one C pass)
        return [] if sampling[0] is None else [(0, sampling[0])]
    first: dict[int, tuple[int, SamplingParams]] = {}
    for row, params in enumerate(sampling):
        if params is not None and id(params) not in first:
            first[id(params)] = (row, params)
    return list(first.values())


def _first(flags) -> int | None:
    """Index of the first truthy flag, else None (one C-level scan that stops at the hit)."""
    try:
        return indexOf(map(truth, flags), True)
    except ValueError:
        return None


def _hit_at(column: tuple, field: str, flags) -> Hit | None:
    """A hit at the first row whose flag is set (its value taken from ``column``), else None."""
    i = _first(flags)
    return None if i is None else Hit(i, field, column[i])


def _in_uint32(ints: Sequence[int]) -> bool:
    """Whether every int lies in ``[0, 2**32)``: an unsigned C array refuses any other while it converts.

    One C pass that needs no comparison of boxed ints (as ``min()`` does),
    whatever the ids' order.
    """
    try:
        array("I", ints)
    except OverflowError:
        return False
    return True


def _all_ints(column: tuple) -> bool:
    """Every entry's type is exactly int (a bool is not a length, slot or block id)."""
    return _INT.issuperset(map(type, column))


# ---------------------------------------------------------------- batch stage


def column_not_tuple(scope: Scope) -> Hit | None:
    for name in COLUMNS:
        value = getattr(scope.batch, name)
        if type(value) is not tuple:
            return Hit(None, name, value, shown=type(value).__name__)
    return None


def column_length(scope: Scope) -> Hit | None:
    n = len(scope.batch.lengths)
    for name in COLUMNS[1:]:
        size = len(getattr(scope.batch, name))
        if size != n:
            return Hit(None, name, size, f" ({n} rows)", shown=f"<{size} entries>")
    return None


def empty(scope: Scope) -> Hit | None:
    return Hit(None, "rows", ()) if not scope.batch.lengths else None


def bad_length(scope: Scope) -> Hit | None:
    lengths = scope.batch.lengths
    if _all_ints(lengths) and min(lengths, default=1) > 0:
        return None
    i = _first(type(n) is not int or n <= 0 for n in lengths)
    return None if i is None else Hit(i, "length", lengths[i])


def bad_cached(scope: Scope) -> Hit | None:
    batch = scope.batch
    if _all_ints(batch.cached) and not any(batch.cached):  # nothing cached: the common wave
        return None
    i = _first(type(c) is not int or not 0 <= c <= n for c, n in zip(batch.cached, batch.lengths))
    return None if i is None else Hit(i, "cached", batch.cached[i], f" (length={batch.lengths[i]})")


def negative_slot(scope: Scope) -> Hit | None:
    slots = scope.batch.slots
    if _all_ints(slots) and min(slots, default=0) >= 0:
        return None
    i = _first(type(s) is not int or s < 0 for s in slots)
    return None if i is None else Hit(i, "slot", slots[i])


def repeated_slot(scope: Scope) -> Hit | None:
    slots = scope.batch.slots
    if len(set(slots)) == len(slots):
        return None
    seen: dict[int, int] = {}
    for row, slot in enumerate(slots):
        first = seen.setdefault(slot, row)
        if first != row:
            return Hit(row, "slot", slot, f"; row {first} already uses it")
    return None


def blocks_not_tuple(scope: Scope) -> Hit | None:
    blocks = scope.batch.blocks
    if {tuple}.issuperset(map(type, blocks)):
        return None
    i = _first(type(b) is not tuple for b in blocks)
    return None if i is None else Hit(i, "blocks", blocks[i], shown=type(blocks[i]).__name__)


def block_not_int(scope: Scope) -> Hit | None:
    blocks = scope.batch.blocks
    if _INT.issuperset(map(type, chain.from_iterable(blocks))):
        return None
    for row, entries in enumerate(blocks):
        for column, block in enumerate(entries):
            if type(block) is not int:
                return Hit(row, f"blocks[{column}]", block)
    return None


def bad_sampling_type(scope: Scope) -> Hit | None:
    sampling = scope.batch.sampling
    if _SAMPLING_TYPES.issuperset(map(type, sampling)):
        return None
    i = _first(s is not None and not isinstance(s, SamplingParams) for s in sampling)
    return None if i is None else Hit(i, "sampling", sampling[i])


# ---------------------------------------------------------------- plan stage: rows


def unaligned_cached(scope: Scope) -> Hit | None:
    cached = scope.batch.cached
    if not any(cached):  # nothing cached (the common batch): aligned
        return None
    return _hit_at(cached, "cached", map(mod, cached, repeat(scope.limits.block_size)))


def slot_beyond_lane(scope: Scope) -> Hit | None:
    slots = scope.batch.slots
    if max(slots) < scope.limits.lane_size:  # one C pass proves every row; the scan finds the first
        return None
    return _hit_at(slots, "slot", map(ge, slots, repeat(scope.limits.lane_size)))


def beyond_capacity(scope: Scope) -> Hit | None:
    lengths = scope.batch.lengths
    if scope.longest <= scope.limits.capacity:
        return None
    return _hit_at(lengths, "length", map(gt, lengths, repeat(scope.limits.capacity)))


def beyond_max_position(scope: Scope) -> Hit | None:
    limit = scope.limits.max_position
    if limit is None:
        return None
    lengths = scope.batch.lengths
    if scope.longest <= limit:
        return None
    return _hit_at(lengths, "length", map(gt, lengths, repeat(limit)))


def short_prefix(scope: Scope) -> Hit | None:
    blocks, needs = scope.batch.blocks, scope.needs
    if not any(map(lt, scope.widths, needs)):
        return None
    i = _first(map(lt, scope.widths, needs))
    have = len(blocks[i])
    return Hit(i, "blocks", have, f" (length={scope.batch.lengths[i]} needs {needs[i]})", shown=f"<{have} entries>")


# ---------------------------------------------------------------- plan stage: block ids


def block_outside_pool(scope: Scope) -> Hit | None:
    ids = scope.mapped_ids
    if _in_uint32(ids) and max(ids) < scope.limits.num_blocks:  # else the walk below finds the offender
        return None
    pool = scope.limits.num_blocks
    for row, prefix in enumerate(scope.prefixes):
        for column, block in enumerate(prefix):
            if not 0 <= block < pool:
                return Hit(row, f"blocks[{column}]", block)
    return None


def repeated_in_row(scope: Scope) -> Hit | None:
    if not scope.has_repeats:
        return None
    for row, prefix in enumerate(scope.prefixes):
        if len(set(prefix)) == len(prefix):
            continue
        seen: dict[int, int] = {}
        for column, block in enumerate(prefix):
            first = seen.setdefault(block, column)
            if first != column:
                return Hit(row, f"blocks[{column}]", block, f"; it is also at column {first}")
    return None


def two_writers(scope: Scope) -> Hit | None:
    if not scope.has_repeats:
        return None
    writer: dict[int, int] = {}
    for row, (prefix, lo) in enumerate(zip(scope.prefixes, scope.first_written)):
        for column in range(lo, len(prefix)):
            block = prefix[column]
            other = writer.setdefault(block, row)
            if other != row:
                return Hit(row, f"blocks[{column}]", block, f"; row {other} also writes it")
    return None


def cached_overwritten(scope: Scope) -> Hit | None:
    if not scope.has_repeats or not any(scope.first_written):
        return None
    pairs = zip(scope.prefixes, scope.first_written)
    writer = {block: row for row, (prefix, lo) in enumerate(pairs) for block in prefix[lo:]}
    for row, (prefix, lo) in enumerate(zip(scope.prefixes, scope.first_written)):
        for column in range(lo):
            other = writer.get(prefix[column])
            if other is not None:
                return Hit(row, f"blocks[{column}]", prefix[column], f"; row {other} writes it")
    return None


def shared_at_other_column(scope: Scope) -> Hit | None:
    if not scope.has_repeats or not any(scope.first_written):
        return None
    first: dict[int, tuple[int, int]] = {}
    for row, (prefix, lo) in enumerate(zip(scope.prefixes, scope.first_written)):
        for column in range(lo):
            other_row, other_column = first.setdefault(prefix[column], (row, column))
            if other_column != column:
                detail = f"; row {other_row} maps it at column {other_column}"
                return Hit(row, f"blocks[{column}]", prefix[column], detail)
    return None


# ---------------------------------------------------------------- plan stage: sampling


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: int | float) -> bool:
    """``math.isfinite`` that calls an int too large for a float infinite instead of raising."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


# Each sampling rule judges each distinct parameter object once, at its first row.


def bad_temperature(scope: Scope) -> Hit | None:
    for row, params in scope.distinct_sampling:
        t = params.temperature
        if not _is_real(t) or not _is_finite(t) or t < 0:
            return Hit(row, "sampling.temperature", t)
    return None


def bad_top_k(scope: Scope) -> Hit | None:
    for row, params in scope.distinct_sampling:
        k = params.top_k
        if type(k) is not int or k < 0:
            return Hit(row, "sampling.top_k", k)
    return None


def bad_top_p(scope: Scope) -> Hit | None:
    for row, params in scope.distinct_sampling:
        p = params.top_p
        if not _is_real(p) or not 0 < p <= 1:
            return Hit(row, "sampling.top_p", p)
    return None


def bad_seed(scope: Scope) -> Hit | None:
    for row, params in scope.distinct_sampling:
        seed = params.seed
        if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
            return Hit(row, "sampling.seed", seed)
    return None


def bad_num_logprobs(scope: Scope) -> Hit | None:
    limit = scope.limits.max_logprobs
    for row, params in scope.distinct_sampling:
        n = params.num_logprobs
        if type(n) is not int or not 0 <= n <= limit:
            return Hit(row, "sampling.num_logprobs", n)
    return None


def bad_prompt_logprobs(scope: Scope) -> Hit | None:
    limit = scope.limits.max_logprobs
    for row, params in scope.distinct_sampling:
        n = params.prompt_logprobs
        if n is not None and (type(n) is not int or not 0 <= n <= limit):
            return Hit(row, "sampling.prompt_logprobs", n)
    return None


def bad_prompt_start(scope: Scope) -> Hit | None:
    # Judged per row, not per parameter object: the range depends on each row's cached offset and length.
    batch = scope.batch
    for row, params in enumerate(batch.sampling):
        start = None if params is None else params.prompt_start
        if start is None:
            continue
        if type(start) is not int or not batch.cached[row] <= start <= batch.lengths[row] - 1:
            return Hit(row, "sampling.prompt_start", start)
    return None
