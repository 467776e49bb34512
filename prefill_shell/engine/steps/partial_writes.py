"""Partial writes: which steps of a request started, and the blocks a failed request may have left half written.

A request's steps write KV blocks in order. When an error interrupts a
request once its first step started, the blocks its started steps write may
hold partial writes (earlier chunks whole, the failing one possibly some
layers only); ``note_partial_writes`` tells the caller which, on the error
itself, so a serving engine can drop them from its prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable

from prefill_core import PackedRequest, PrefillRequest
from prefill_shell.device.notes import add_note

__all__ = ["StepLog", "note_partial_writes"]


class StepLog:
    """How far one request's steps got: the step loop reports each step started and finished.

    ``written_blocks`` reads the request's own plan (``written_blocks(i)`` of
    the request protocol) for the started steps, so it names the same blocks
    whether the steps ran eagerly or replayed a trace, padded or packed.
    """

    def __init__(self, request: PrefillRequest | PackedRequest, on_finished: Callable[[int], None] | None = None):
        self.request = request
        self.started = 0
        self._on_finished = on_finished

    def step_started(self, index: int) -> None:
        self.started = index + 1

    def step_finished(self, index: int) -> None:
        if self._on_finished is not None:
            self._on_finished(index)

    def written_blocks(self, source_rows: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
        """Per caller row, the sorted KV blocks the started steps write.

        ``source_rows`` always appear (possibly with no blocks); a packed
        step also names the rows it computes for a later request.
        """
        blocks: dict[int, set[int]] = {row: set() for row in source_rows}
        for index in range(self.started):
            for row, written in self.request.written_blocks(index).items():
                blocks.setdefault(row, set()).update(written)
        return {row: tuple(sorted(ids)) for row, ids in blocks.items()}


def note_partial_writes(error: BaseException, blocks: dict[int, tuple[int, ...]]) -> None:
    """Tells the caller which KV blocks the failed request may have left partly written.

    ``error.partial_writes`` maps each caller row of the failed request to
    the sorted blocks its started steps write: earlier chunks (whole, but
    the row's KV is incomplete) and the failing step (possibly some layers
    only). Rows of requests that completed earlier in the same call are
    absent: their KV is whole. A read that fails stops the call with the
    rows its request's packed steps started for a later request partly
    written; it names those (``InvocationResult.unfinished_writes``). A
    serving engine drops these blocks from its
    prefix cache (never matches them as a cached prefix) and recomputes the
    rows, or frees the blocks with the failed requests.
    """
    try:
        error.partial_writes = blocks
    except AttributeError:  # an exception type without a __dict__: the note still carries it
        pass
    listed = "; ".join(f"row {row}: blocks {list(ids)}" for row, ids in blocks.items())
    add_note(
        error,
        f"partial writes: KV blocks that may hold partial writes of the failed request ({listed}); "
        "rows of requests completed earlier in this call hold whole KV",
    )
