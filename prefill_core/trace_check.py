"""``can_trace``: whether every step a call of these lengths would plan has a trace identity (a static question).

tt-transformers' runtime offers the same question (``can_trace(*, tokens,
prompt_lens, start_pos)``): it looks only at geometry, never at what is
captured, and answers False, not an error, for input it could not plan.
Here a row's step length is what ``plan_prefill`` gives it alone (a wave's
step length is its rows' own), so the answer is per row: every row's step
length must be one of the policy's ``trace_lengths`` (``None``: all are).
Unlike tt-transformers, a fully cached row is plannable (it re-runs its
final block), so it does not make the answer False.
"""

from __future__ import annotations

from collections.abc import Sequence

from .layout import PageTableLayout
from .plan import chunk_plan
from .policy import PrefillPolicy

__all__ = ["can_trace", "step_length"]


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
