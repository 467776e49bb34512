"""``PreparedBatch``: one prepared call, and the checks that it may run where it is invoked."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from prefill_core import PageTableLayout, PreparedPrefill
from prefill_core.calls.call_plan import CallPlan
from prefill_core.values.errors import PrefillInputError, PrefillStateError
from prefill_shell.engine.steps.inputs import HostStep
from prefill_shell.engine.steps.pooled_states import PooledStates
from prefill_shell.engine.steps.prompt_logprobs import PromptEntries, PromptPiece

__all__ = ["PreparedBatch", "check_runnable", "checked_request"]


@attrs.frozen(eq=False)
class PreparedBatch:
    """One prepared call: its requests in plan order and each request's host step values.

    ``requests[i]`` is a ``PreparedPrefill`` (the planned request, its
    sampling path and its program and trace identities); ``steps[i]`` are
    its host step values, one per chunk.

    ``runtime`` and ``layout`` record what it was planned for: ``invoke``
    refuses it on another runtime (another KV pool) or after
    ``configure_page_table_layout`` changed the layout (its blocks may lie
    outside the new pool), before anything is written.
    """

    requests: tuple[PreparedPrefill, ...]
    steps: tuple[Sequence[HostStep], ...]  # a chunked request's: inputs.ChunkedSteps, views made when read
    num_rows: int
    runtime: object = attrs.field(repr=False)
    layout: PageTableLayout
    # Per request, per step: the prompt log-prob pieces (``prompt_logprobs.prompt_steps``);
    # None for a request whose steps score none, () for a call where no row asks.
    prompt_steps: tuple[tuple[tuple[PromptPiece, ...], ...] | None, ...] = ()
    # Prompt log-probs scored so far, until the request that returns their row takes them.
    prompt_entries: PromptEntries = attrs.field(factory=PromptEntries, repr=False)
    # The core's plan of the call (``prefill_core.plan_call``): its kind, gaps and replay decision.
    plan: CallPlan | None = attrs.field(default=None, repr=False)
    # The rows whose final hidden states the call pools (``pooled_states``); None when no row asks.
    pooled: PooledStates | None = attrs.field(default=None, repr=False)

    @property
    def num_steps(self) -> int:
        """Model-body steps of the whole call (the ``"prefill"`` progress total)."""
        return sum(len(steps) for steps in self.steps)


def check_runnable(batch: object, runtime: object, layout: PageTableLayout) -> None:
    """Raises unless ``batch`` is a ``PreparedBatch`` planned by ``runtime`` for ``layout``."""
    if not isinstance(batch, PreparedBatch):
        raise PrefillInputError(
            f"batch={batch!r} is invalid: must be a PreparedBatch from PrefillRuntime.prepare: nothing was run",
            field="batch",
        )
    if batch.runtime is not runtime:
        raise PrefillStateError(
            "this PreparedBatch was prepared by another PrefillRuntime (another KV pool and "
            "layout); prepare it on this one: nothing was run"
        )
    if batch.layout is not layout and batch.layout != layout:
        raise PrefillStateError(
            f"this PreparedBatch was planned for {batch.layout}, but the runtime's layout is now "
            f"{layout} (configure_page_table_layout); prepare it again: nothing was run"
        )


def checked_request(batch: object, index: object, runtime: object, layout: PageTableLayout) -> PreparedPrefill:
    """Request ``index`` of ``batch``, once ``check_runnable`` passed and ``index`` names one of its requests."""
    check_runnable(batch, runtime, layout)
    count = len(batch.requests)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise PrefillInputError(
            f"invoke: index={index!r} is invalid: must be an int in [0, {count}) (the batch holds {count} "
            "requests): nothing was run",
            field="index",
        )
    return batch.requests[index]
