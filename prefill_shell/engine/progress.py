"""Progress of long operations.

A long operation takes an optional ``on_progress`` callback and calls it
with a frozen ``Progress(stage, done, total, detail)`` value:

* ``PrefillExecutor.warm_up``: stage ``"cost"`` (total 0, its detail the
  ``prefill_core.calls.warmup.WarmupCost``: bodies, positions and persistent bytes,
  before anything runs), then ``"compile"`` (program signatures the backend
  builds), ``"allocate"`` (alias workspaces) and ``"capture"`` (traces),
  one stage after the other (``compile_programs``: ``"cost"`` and ``"compile"``);
* ``PrefillRuntime.prefill`` / ``invocations`` and ``PrefillExecutor.prefill`` /
  ``invocations``: stage ``"prefill"``, one unit per model-body step (a chunk
  of a request) of the whole call, eager or traced.

Each stage reports ``done = 0`` when it starts and then ``1, 2, ..., total``
in order as units finish (a step counts when its body has been dispatched;
on an asynchronous device, enqueued). ``detail`` names the unit just
finished, e.g. ``"rows (0,) chunk 2/3"``; it is for display, not parsing.
The callback runs on the calling thread inside the call: an exception it
raises propagates unchanged, with every device tensor released as for any
other failure.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

__all__ = ["Progress", "ProgressCallback", "ProgressCounter"]


@attrs.frozen
class Progress:
    """``done`` of ``total`` units of ``stage`` have finished; ``detail`` names the last one."""

    stage: str
    done: int
    total: int
    detail: str = ""


ProgressCallback = Callable[[Progress], None]


class ProgressCounter:
    """Counts one stage's units and reports each to ``on_progress`` (``None``: counts silently)."""

    def __init__(self, on_progress: ProgressCallback | None, stage: str, total: int):
        self._on_progress = on_progress
        self.stage = stage
        self.total = total
        self.done = 0

    def start(self, detail: str = "") -> ProgressCounter:
        """Reports ``done = 0`` (with ``detail``: what the stage is about to do); returns self."""
        self._report(detail)
        return self

    def advance(self, detail: str = "") -> None:
        """One more unit finished."""
        self.done += 1
        self._report(detail)

    def _report(self, detail: str) -> None:
        if self._on_progress is not None:
            self._on_progress(Progress(self.stage, self.done, self.total, detail))
