"""How a call runs, and the one decision it implies for planning: packed steps or padded waves.

``ExecutionMode`` is the one spelling of "traced" below the serving facades:
``PrefillRuntime``, ``PrefillExecutor``, ``LaneGroup`` and ``Scorer`` all take
``mode``. A trace replays fixed shapes (padded waves, ``plan.py``); packed
steps (``packed.py``) vary their shapes per call and run eagerly only.
``plans_packed`` and ``replays`` are two of the rules ``call_plan.plan_call``
applies, the one place a call's plan is chosen.
"""

from __future__ import annotations

import enum

from prefill_core.values.errors import PrefillInputError

__all__ = ["ExecutionMode", "execution_mode", "plans_packed", "replays"]


class ExecutionMode(str, enum.Enum):
    """``eager`` runs every body; ``traced`` replays captured traces and never falls back;
    ``auto`` replays when every request of the call has a trace, else runs eagerly."""

    AUTO = "auto"
    EAGER = "eager"
    TRACED = "traced"


def execution_mode(value: ExecutionMode | str) -> ExecutionMode:
    """``value`` as an ``ExecutionMode``; anything else is a ``PrefillInputError`` naming ``mode``."""
    try:
        return ExecutionMode(value)
    except (ValueError, TypeError):
        allowed = [m.value for m in ExecutionMode]
        raise PrefillInputError(f"mode={value!r} is invalid: must be one of {allowed}", field="mode") from None


def plans_packed(lane_runs_packed: bool, mode: ExecutionMode, traces_captured: bool) -> bool:
    """Whether a call is planned as packed steps rather than padded waves.

    ``lane_runs_packed``: the policy asks for packed steps and the backend and
    the model both run them. A traced call, and an ``auto`` call on a lane
    that holds captured traces (it may replay them), is planned as the padded
    waves a trace serves; an eager call, or an ``auto`` call with nothing
    captured, is packed where the lane can. What the rows ask for does not
    matter: either kind returns every output, prompt log-probs included.
    """
    if not lane_runs_packed or mode is ExecutionMode.TRACED:
        return False
    return mode is ExecutionMode.EAGER or not traces_captured


def replays(mode: ExecutionMode, covered: bool) -> bool:
    """Whether a call (or one request) in ``mode`` runs by trace replay; ``covered``: every request has a trace.

    ``traced`` replays (an uncovered call is refused before it runs, not run
    eagerly); ``auto`` replays exactly when covered; ``eager`` never does.
    """
    return mode is ExecutionMode.TRACED or (mode is ExecutionMode.AUTO and covered)
