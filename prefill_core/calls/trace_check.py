"""``can_trace``: whether every step a call of these lengths would plan has a trace identity (a static question).

tt-transformers' runtime offers the same question (``can_trace(*, tokens,
prompt_lens, start_pos)``): it looks only at geometry, never at what is
captured, and answers False, not an error, for input it could not plan.
Here a row's step length is what ``plan_prefill`` gives it alone (a wave's
step length is its rows' own), so the answer is per row: every row's step
length must be one of the policy's ``trace_lengths`` (``None``: all are).
Unlike tt-transformers, a fully cached row is plannable (it re-runs its
final block), so it does not make the answer False.

``replays_call`` is the question a serving engine means by it on a lane
that has warmed up: whether a traced call of these rows would replay every
request *on what the lane captured*. It plans the call with ``plan_call``
(the function the runtime plans with) over fresh, distinct block ids, so
its answer is the traced call's: True exactly when that call runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from prefill_core.calls.call_plan import CallContext, plan_call
from prefill_core.inputs.batch import PrefillBatch
from prefill_core.planning.plan import chunk_plan
from prefill_core.values.errors import PrefillInputError
from prefill_core.values.execution import ExecutionMode
from prefill_core.values.intmath import ceil_div
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy

__all__ = ["can_trace", "replays_call", "step_length"]


def step_length(length: int, cached: int, policy: PrefillPolicy, block_size: int) -> int:
    """Positions of each step ``plan_prefill`` gives a row of ``length`` tokens, ``cached`` of them cached."""
    if policy.is_regular(length, cached):
        return policy.padded_length(length)
    return chunk_plan(length, cached, policy, block_size)[0]


def can_trace(lengths: Sequence[int], cached: Sequence[int], policy: PrefillPolicy, layout: PageTableLayout) -> bool:
    """Whether a call of rows ``(length, cached)`` plans only traceable steps; False for rows it cannot plan."""
    if not isinstance(policy, PrefillPolicy) or not isinstance(layout, PageTableLayout):
        return False
    if not lengths or len(lengths) != len(cached):
        return False
    for length, done in zip(lengths, cached):
        if type(length) is not int or type(done) is not int or not 0 <= done <= length or length < 1:
            return False
        if length > layout.capacity:
            return False
        if not policy.is_trace_eligible(step_length(length, done, policy, layout.block_size)):
            return False
    return True


def _fresh_ids(counts, skip: int | None, start: int) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Rows of ``counts[r]`` block ids, all distinct, from ``start`` on, never ``skip``; and the next free id."""
    rows, next_id = [], start
    for count in counts:
        row = []
        while len(row) < count:
            if next_id != skip:
                row.append(next_id)
            next_id += 1
        rows.append(tuple(row))
    return tuple(rows), next_id


def replays_call(
    lengths: Sequence[int],
    cached: Sequence[int],
    context: CallContext,
    slots: Sequence[int] | None = None,
    sampling: Sequence | None = None,
) -> bool:
    """Whether a ``traced`` call of rows ``(length, cached)`` on the lane ``context`` describes replays every
    request (``plan_call``); False for rows a call would refuse. ``context.mode`` is ignored (a traced call is
    asked about); block ids are fresh and distinct (their values never change a plan's geometry).
    ``sampling``: each row's ``SamplingParams`` or None (the default: every row asks for logits, as a caller
    that has not said otherwise, such as the plugin's ``can_trace``), since sampled rows wave differently."""
    if not isinstance(context, CallContext) or not lengths or len(lengths) != len(cached):
        return False
    if any(type(n) is not int or type(c) is not int or not 0 <= c <= n or n < 1 for n, c in zip(lengths, cached)):
        return False
    layout, skip = context.layout, context.null_block
    blocks, next_id = _fresh_ids([ceil_div(n, layout.block_size) for n in lengths], skip, 0)
    groups = None
    if context.attention is not None:
        groups = []
        for group in context.attention.groups:
            rows, next_id = _fresh_ids([ceil_div(n, group.block_size) for n in lengths], skip, next_id)
            groups.append(rows)
        groups = tuple(groups)
    wide = attrs.evolve(layout, num_blocks=max(layout.num_blocks, next_id + 1))
    chosen = slots is not None
    try:
        batch = PrefillBatch(
            tuple(lengths),
            tuple(cached),
            tuple(slots if chosen else range(len(lengths))),
            blocks,
            (None,) * len(lengths) if sampling is None else tuple(sampling),
        )
        asked = attrs.evolve(context, layout=wide, mode=ExecutionMode.TRACED, slots_chosen=chosen, group_tables=groups)
        return not plan_call(batch, asked).gaps
    except PrefillInputError:
        return False
