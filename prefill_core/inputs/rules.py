"""Every input rule, once: the rule table and the one loop that applies it.

Theory of operation
-------------------
``RULES`` lists each rule a caller's batch must satisfy as a ``Rule``: a
short name, the ``PrefillInputError`` subclass it raises, the field it
judges, the rule text (a template over ``Limits``) and one ``find``
function. ``find`` is the rule's only definition: it scans the batch and
returns the first row (in caller order) that breaks the rule as a ``Hit``,
or ``None``. ``check`` walks a stage's rules in table order and raises the
first hit, so the error always names the row, the field, the value and the
rule, and nothing is planned.

Two stages: ``batch`` rules need only the rows (``PrefillBatch`` checks them
when it is built); ``plan`` rules also need the layout and policy
(``check_inputs`` runs them before planning). Table order matters: types
before ranges (a range check may then compare ints only), ranges before
block ids, and block ids before the rules that index the KV pool.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from prefill_core.inputs import rule_finds as find
from prefill_core.inputs.rule_finds import Hit, Limits, Scope
from prefill_core.values.errors import (
    BlockConflictError,
    CapacityError,
    EmptyBatchError,
    InvalidCachedLengthError,
    InvalidLengthError,
    InvalidPageTableError,
    InvalidSamplingError,
    InvalidSlotError,
    PositionLimitError,
    PrefillInputError,
    RepeatedBlockError,
    SharedBlockColumnError,
)

__all__ = ["Rule", "RULES", "BLOCK_RULES", "Hit", "Limits", "Scope", "check"]


@attrs.frozen
class Rule:
    """One input rule: what it is called, what it raises, what it judges, how it is found."""

    name: str
    error: type[PrefillInputError]
    field: str
    text: str
    stage: str
    find: Callable[[Scope], Hit | None] = attrs.field(eq=False, repr=False)

    def error_for(self, hit: Hit, limits: Limits | None) -> PrefillInputError:
        """The named error for ``hit``: row, field, value and the rule's text."""
        rule = self.text.format_map(attrs.asdict(limits)) if limits is not None else self.text
        rule += hit.detail
        shown = hit.shown if hit.shown is not None else repr(hit.value)
        if hit.row is None:
            msg = f"PrefillBatch.{hit.field}={shown} is invalid: {rule}"
        else:
            msg = f"row {hit.row}: {hit.field}={shown} is invalid: {rule}"
        return self.error(msg, row=hit.row, field=hit.field)


_IN_POOL = "mapped entries must be block ids in [0, num_blocks={num_blocks})"

RULES: tuple[Rule, ...] = (
    # -- batch: the rows on their own ----------------------------------
    Rule("columns are tuples", PrefillInputError, "<column>", "must be a tuple", "batch", find.column_not_tuple),
    Rule(
        "one entry per row", PrefillInputError, "<column>", "must hold one entry per row", "batch", find.column_length
    ),
    Rule("non-empty", EmptyBatchError, "rows", "a batch needs at least one row", "batch", find.empty),
    Rule("length > 0", InvalidLengthError, "length", "must be an int > 0", "batch", find.bad_length),
    Rule(
        "0 <= cached <= length",
        InvalidCachedLengthError,
        "cached",
        "must be an int in [0, length]",
        "batch",
        find.bad_cached,
    ),
    Rule("slot >= 0", InvalidSlotError, "slot", "must be an int >= 0", "batch", find.negative_slot),
    Rule("unique slots", InvalidSlotError, "slot", "a slot takes one row per batch", "batch", find.repeated_slot),
    Rule(
        "blocks is a tuple",
        InvalidPageTableError,
        "blocks",
        "must be a tuple of block ids",
        "batch",
        find.blocks_not_tuple,
    ),
    Rule(
        "block ids are ints", InvalidPageTableError, "blocks[j]", "block ids must be ints", "batch", find.block_not_int
    ),
    Rule(
        "sampling type",
        InvalidSamplingError,
        "sampling",
        "must be None or SamplingParams",
        "batch",
        find.bad_sampling_type,
    ),
    # -- plan: the rows against the layout and policy --------------------
    Rule(
        "slot < lane_size",
        InvalidSlotError,
        "slot",
        "must be < lane_size={lane_size} (a lane holds {lane_size} slots, 0..{lane_size}-1; "
        "callers without explicit slots split rows into sub-batches of {lane_size})",
        "plan",
        find.slot_beyond_lane,
    ),
    Rule(
        "length <= capacity",
        CapacityError,
        "length",
        "must be <= the layout's capacity {capacity} (block_size * max_num_blocks_per_seq)",
        "plan",
        find.beyond_capacity,
    ),
    Rule(
        "length <= max_position",
        PositionLimitError,
        "length",
        "must be <= the model's max_position={max_position} (positions past it have no rotary embedding)",
        "plan",
        find.beyond_max_position,
    ),
    Rule(
        "mapped prefix complete",
        InvalidPageTableError,
        "blocks",
        "the mapped prefix needs ceil(length / block_size={block_size}) entries",
        "plan",
        find.short_prefix,
    ),
    Rule("block ids in the pool", InvalidPageTableError, "blocks[j]", _IN_POOL, "plan", find.block_outside_pool),
    Rule(
        "no repeated block in a row",
        RepeatedBlockError,
        "blocks[j]",
        "a row maps each block once (cached part included); a block holds one run of positions",
        "plan",
        find.repeated_in_row,
    ),
    Rule(
        "one writer per block", BlockConflictError, "blocks[j]", "one block takes one writer", "plan", find.two_writers
    ),
    Rule(
        "a block read as cached is written whole at its column",
        BlockConflictError,
        "blocks[j]",
        "a block one row reads as cached while another row of the call writes it must be written whole, "
        "at the column where it is read (the writer then runs first)",
        "plan",
        find.cached_block_not_written_whole,
    ),
    Rule(
        "shared cached block at one column",
        SharedBlockColumnError,
        "blocks[j]",
        "rows sharing a cached block must map it at the same column (the same positions)",
        "plan",
        find.shared_at_other_column,
    ),
    Rule(
        "temperature",
        InvalidSamplingError,
        "sampling.temperature",
        "must be a finite number >= 0",
        "plan",
        find.bad_temperature,
    ),
    Rule("top_k", InvalidSamplingError, "sampling.top_k", "must be an int >= 0 (0 = no limit)", "plan", find.bad_top_k),
    Rule("top_p", InvalidSamplingError, "sampling.top_p", "must be a number in (0, 1]", "plan", find.bad_top_p),
    Rule("seed", InvalidSamplingError, "sampling.seed", "must be None or an int in [0, 2**63)", "plan", find.bad_seed),
    Rule(
        "num_logprobs",
        InvalidSamplingError,
        "sampling.num_logprobs",
        "must be an int in [0, {max_logprobs}] (the policy's max_logprobs)",
        "plan",
        find.bad_num_logprobs,
    ),
    Rule(
        "prompt_logprobs",
        InvalidSamplingError,
        "sampling.prompt_logprobs",
        "must be None or an int in [0, {max_logprobs}] (the policy's max_logprobs)",
        "plan",
        find.bad_prompt_logprobs,
    ),
    Rule(
        "prompt_start",
        InvalidSamplingError,
        "sampling.prompt_start",
        "must be None or an int in [cached, length - 1] (the first position whose next token is scored)",
        "plan",
        find.bad_prompt_start,
    ),
)

_BY_STAGE = {stage: tuple(rule for rule in RULES if rule.stage == stage) for stage in ("batch", "plan")}


BLOCK_RULES = frozenset(rule.name for rule in RULES if rule.stage == "plan" and rule.field.startswith("blocks"))
"""The plan rules over ``batch.blocks`` (ids in the pool, repeats, writers, sharing)."""


def check(stage: str, scope: Scope, *, skip: frozenset[str] | tuple[str, ...] = ()) -> None:
    """Raises the first rule of ``stage`` (in table order, ``skip``'s names aside) that ``scope``'s batch breaks."""
    for rule in _BY_STAGE[stage]:
        if rule.name in skip:
            continue
        hit = rule.find(scope)
        if hit is not None:
            raise rule.error_for(hit, scope.limits) from None
