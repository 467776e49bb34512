"""How each input rule finds the first row that breaks it (``rules.RULES`` names them).

Every function here takes a ``Scope`` (the batch, plus the layout and policy
limits in the plan stage) and returns the first ``Hit`` in caller row order,
or ``None``. Each function is the only place its rule is written: one loop
over the rows (or their block ids) stating the rule.
"""

from __future__ import annotations

import math
from functools import cached_property

import attrs

from prefill_core.values.intmath import ceil_div_column
from prefill_core.values.sampling import SamplingParams

COLUMNS = ("lengths", "cached", "slots", "blocks", "sampling")


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
    rules: ints and tuples throughout) these columns are built here at once:

    * ``needs``: each row's mapped block count, ``ceil(length / block_size)``
      (the planner reads it too);
    * ``prefixes``: each row's mapped prefix, its first ``needs`` entries;
    * ``has_repeats``: whether any block id is mapped twice in the batch.

    ``has_repeats`` and ``block_outside_pool``'s per-row range are the two
    fast paths of the block-id rules, kept because a 4096-block row (the
    ``plan_131072_*`` rows of benchmarks/plan_overhead.py) measurably pays
    for the walks they skip: a row's min and max clear it of
    ``block_outside_pool``, and the three repeat rules can fire only when
    ``has_repeats``, so a batch without a repeat skips their dict walks.
    """

    def __init__(self, batch, limits: Limits | None = None):
        self.batch = batch
        self.limits = limits
        if limits is None:
            return
        self.needs = ceil_div_column(batch.lengths, limits.block_size)
        self.prefixes = [blocks[:need] for blocks, need in zip(batch.blocks, self.needs)]
        self.has_repeats = len(set().union(*self.prefixes)) != sum(len(prefix) for prefix in self.prefixes)

    @cached_property
    def first_written(self) -> list[int]:
        """Each row's first written column (``computed_positions.written_columns``).

        ``cached // block_size``, or the mapped width for a fully cached row,
        which writes nothing and reads every mapped block.
        """
        bs = self.limits.block_size
        batch = self.batch
        return [c // bs if c < n else need for c, n, need in zip(batch.cached, batch.lengths, self.needs)]

    @cached_property
    def distinct_sampling(self) -> list[tuple[int, SamplingParams]]:
        """``(first row, params)`` for each distinct parameter object (rows usually share a few), None excluded."""
        first: dict[int, tuple[int, SamplingParams]] = {}
        for row, params in enumerate(self.batch.sampling):
            if params is not None and id(params) not in first:
                first[id(params)] = (row, params)
        return list(first.values())


def type_note(value: object, wanted: type[int] | type[float]) -> str:
    """Words a rule adds when ``value`` is not of the ``wanted`` Python type: the type given and the conversion.

    A numpy or torch scalar prints as the number it holds (``np.int64(20)``
    as ``20``), so "top_k=20 must be an int" alone reads as a contradiction.
    ``float`` means any real (an int or a float, never a bool). Empty when
    the type is right: the value itself broke the rule.
    """
    kind = type(value)
    if kind is wanted or wanted is float and _is_real(value):
        return ""
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    what = "int" if wanted is int else "float or int"
    return f"; got {name}, not a Python {what}: convert it with {wanted.__name__}()"


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
    for row, length in enumerate(scope.batch.lengths):
        if type(length) is not int or length <= 0:
            return Hit(row, "length", length, type_note(length, int))
    return None


def bad_cached(scope: Scope) -> Hit | None:
    batch = scope.batch
    for row, (cached, length) in enumerate(zip(batch.cached, batch.lengths)):
        if type(cached) is not int or not 0 <= cached <= length:
            return Hit(row, "cached", cached, f" (length={length})" + type_note(cached, int))
    return None


def negative_slot(scope: Scope) -> Hit | None:
    for row, slot in enumerate(scope.batch.slots):
        if type(slot) is not int or slot < 0:
            return Hit(row, "slot", slot, type_note(slot, int))
    return None


def repeated_slot(scope: Scope) -> Hit | None:
    seen: dict[int, int] = {}
    for row, slot in enumerate(scope.batch.slots):
        first = seen.setdefault(slot, row)
        if first != row:
            return Hit(row, "slot", slot, f"; row {first} already uses it")
    return None


def blocks_not_tuple(scope: Scope) -> Hit | None:
    for row, blocks in enumerate(scope.batch.blocks):
        if type(blocks) is not tuple:
            return Hit(row, "blocks", blocks, shown=type(blocks).__name__)
    return None


def block_not_int(scope: Scope) -> Hit | None:
    for row, blocks in enumerate(scope.batch.blocks):
        # The set of a row's types first: a 131072-token row maps 4096 blocks, and the column walk
        # costs most of its batch check (benchmarks/vs_tt_metal_planner.py, case 131072_cached_2048).
        if set(map(type, blocks)) <= {int}:
            continue
        for column, block in enumerate(blocks):
            if type(block) is not int:
                return Hit(row, f"blocks[{column}]", block, type_note(block, int))
    return None


def bad_sampling_type(scope: Scope) -> Hit | None:
    for row, params in enumerate(scope.batch.sampling):
        if params is not None and not isinstance(params, SamplingParams):
            return Hit(row, "sampling", params)
    return None


# ---------------------------------------------------------------- plan stage: rows


def slot_beyond_lane(scope: Scope) -> Hit | None:
    lane = scope.limits.lane_size
    for row, slot in enumerate(scope.batch.slots):
        if slot >= lane:
            return Hit(row, "slot", slot)
    return None


def beyond_capacity(scope: Scope) -> Hit | None:
    capacity = scope.limits.capacity
    for row, length in enumerate(scope.batch.lengths):
        if length > capacity:
            return Hit(row, "length", length)
    return None


def beyond_max_position(scope: Scope) -> Hit | None:
    limit = scope.limits.max_position
    if limit is None:
        return None
    for row, length in enumerate(scope.batch.lengths):
        if length > limit:
            return Hit(row, "length", length)
    return None


def short_prefix(scope: Scope) -> Hit | None:
    batch = scope.batch
    for row, (blocks, need) in enumerate(zip(batch.blocks, scope.needs)):
        if len(blocks) < need:
            detail = f" (length={batch.lengths[row]} needs {need})"
            return Hit(row, "blocks", len(blocks), detail, shown=f"<{len(blocks)} entries>")
    return None


# ---------------------------------------------------------------- plan stage: block ids


def block_outside_pool(scope: Scope) -> Hit | None:
    pool = scope.limits.num_blocks
    for row, prefix in enumerate(scope.prefixes):
        if not prefix or (0 <= min(prefix) and max(prefix) < pool):  # the row's range first (see Scope)
            continue
        for column, block in enumerate(prefix):
            if not 0 <= block < pool:
                return Hit(row, f"blocks[{column}]", block)
    return None


def repeated_in_row(scope: Scope) -> Hit | None:
    if not scope.has_repeats:
        return None
    for row, prefix in enumerate(scope.prefixes):
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


def cached_block_not_written_whole(scope: Scope) -> Hit | None:
    """A block one row reads as cached while another writes it: legal only written whole, at the same column.

    Such a pair is served by running the writer first (``block_order``), so
    the reader must find the same positions there (the same column) and all
    of them written (the writer's prompt covers the whole block).
    """
    if not scope.has_repeats or not any(scope.first_written):
        return None
    writer: dict[int, tuple[int, int]] = {}
    for row, (prefix, lo) in enumerate(zip(scope.prefixes, scope.first_written)):
        for column in range(lo, len(prefix)):
            writer[prefix[column]] = (row, column)
    lengths, bs = scope.batch.lengths, scope.limits.block_size
    for row, (prefix, lo) in enumerate(zip(scope.prefixes, scope.first_written)):
        for column in range(lo):
            found = writer.get(prefix[column])
            if found is None:
                continue
            other, at = found
            if at != column:
                return Hit(row, f"blocks[{column}]", prefix[column], f"; row {other} writes it at column {at}")
            if lengths[other] < (column + 1) * bs:
                detail = f"; row {other} writes only its first {lengths[other] - column * bs} positions"
                return Hit(row, f"blocks[{column}]", prefix[column], detail)
    return None


def shared_at_other_column(scope: Scope) -> Hit | None:
    if not scope.has_repeats:
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
            return Hit(row, "sampling.temperature", t, type_note(t, float))
    return None


def bad_top_k(scope: Scope) -> Hit | None:
    for row, params in scope.distinct_sampling:
        k = params.top_k
        if type(k) is not int or k < 0:
            return Hit(row, "sampling.top_k", k, type_note(k, int))
    return None


def bad_top_p(scope: Scope) -> Hit | None:
    for row, params in scope.distinct_sampling:
        p = params.top_p
        if not _is_real(p) or not 0 < p <= 1:
            return Hit(row, "sampling.top_p", p, type_note(p, float))
    return None


def bad_seed(scope: Scope) -> Hit | None:
    for row, params in scope.distinct_sampling:
        seed = params.seed
        if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
            return Hit(row, "sampling.seed", seed, type_note(seed, int))
    return None


def bad_num_logprobs(scope: Scope) -> Hit | None:
    limit = scope.limits.max_logprobs
    for row, params in scope.distinct_sampling:
        n = params.num_logprobs
        if type(n) is not int or not 0 <= n <= limit:
            return Hit(row, "sampling.num_logprobs", n, type_note(n, int))
    return None


def bad_prompt_logprobs(scope: Scope) -> Hit | None:
    limit = scope.limits.max_logprobs
    for row, params in scope.distinct_sampling:
        n = params.prompt_logprobs
        if n is not None and (type(n) is not int or not 0 <= n <= limit):
            return Hit(row, "sampling.prompt_logprobs", n, type_note(n, int))
    return None


def bad_prompt_start(scope: Scope) -> Hit | None:
    # Judged per row, not per parameter object: the range depends on each row's cached offset and length.
    batch = scope.batch
    for row, params in enumerate(batch.sampling):
        start = None if params is None else params.prompt_start
        if start is None:
            continue
        if type(start) is not int or not batch.cached[row] <= start <= batch.lengths[row] - 1:
            return Hit(row, "sampling.prompt_start", start, type_note(start, int))
    return None
