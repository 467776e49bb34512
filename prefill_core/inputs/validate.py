"""``check_inputs``: the arguments of a planning call, then the ``plan`` rules of ``rules.RULES``.

Each broken rule raises a named ``PrefillInputError`` subclass whose message
names the row, the field, the value and the rule; nothing is planned on
failure. ``check_inputs`` only validates: what the planner needs it computes
itself.
"""

from __future__ import annotations

import functools

from prefill_core.inputs.batch import PrefillBatch
from prefill_core.inputs.rules import BLOCK_RULES, Limits, Scope, check
from prefill_core.values.errors import PrefillInputError
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy, check_policy_fits_layout

__all__ = ["check_inputs", "checked_scope"]


def _check_arguments(batch: object, policy: object, layout: object, max_position: object) -> None:
    for name, value, kind in (
        ("batch", batch, PrefillBatch),
        ("policy", policy, PrefillPolicy),
        ("layout", layout, PageTableLayout),
    ):
        if not isinstance(value, kind):
            msg = f"{name} must be a {kind.__name__}, got {type(value).__name__}"
            raise PrefillInputError(msg, field=name)
    if max_position is not None and (type(max_position) is not int or max_position <= 0):
        msg = f"max_position={max_position!r} is invalid: must be None or the model's position count, an int > 0"
        raise PrefillInputError(msg, field="max_position")


@functools.lru_cache(maxsize=32)
def _limits(policy: PrefillPolicy, layout: PageTableLayout, max_position: int | None) -> Limits:
    """The numbers the plan rules judge rows against, once the policy fits the layout.

    A pure function of the configuration (a runtime plans every call with
    the same three), so it is kept per configuration; a policy that does
    not fit raises on every call (``lru_cache`` keeps no exception).
    """
    check_policy_fits_layout(policy, layout)
    return Limits(
        layout.block_size, layout.num_blocks, layout.capacity, policy.lane_size, policy.max_logprobs, max_position
    )


def check_inputs(
    batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout, *, max_position: int | None = None
) -> None:
    """Raises the first broken rule as a ``PrefillInputError`` subclass.

    ``max_position`` (the model's maximum position count, e.g. Hugging Face's
    ``max_position_embeddings``) adds the rule ``length <= max_position``;
    ``None`` leaves lengths bounded by the layout's capacity only.
    """
    checked_scope(batch, policy, layout, max_position=max_position)


def checked_scope(
    batch: PrefillBatch,
    policy: PrefillPolicy,
    layout: PageTableLayout,
    *,
    max_position: int | None = None,
    block_rules: bool = True,
) -> Scope:
    """``check_inputs``, returning the judged batch with the columns its rules derived.

    The planner reads the mapped block counts (``Scope.needs``) from it
    rather than dividing every length a second time. ``block_rules=False``
    skips the rules over ``batch.blocks`` (a call with one table per KV
    group judges each group's table by its window: ``group_rules``).
    """
    _check_arguments(batch, policy, layout, max_position)
    scope = Scope(batch, _limits(policy, layout, max_position))
    check("plan", scope, skip=() if block_rules else BLOCK_RULES)
    return scope
