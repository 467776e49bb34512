"""Partial writes: which steps of a request started, and the blocks a failed request may have left half written.

A request's steps write KV blocks in order. When an error interrupts a
request once its first step started, the blocks its started steps write may
hold partial writes (earlier chunks whole, the failing one possibly some
layers only); ``note_partial_writes`` tells the caller which, on the error
itself, so a serving engine can drop them from its prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prefill_core import PackedStep
from prefill_shell.device.contract import FILL_TABLE, GROUP_FILL_TABLES, PACKED_WRITE_SLOTS
from prefill_shell.device.notes import add_note
from prefill_shell.engine.steps.inputs import HostStep

__all__ = ["StepLog", "note_partial_writes"]


class StepLog(list):
    """A request's host steps that record how many were started and report each one finished.

    The step loop (``step_loop.PrefillStepLoop.run``, eager or traced) takes
    the steps with one ``for step in steps`` pass: taking step i means steps
    before it have been dispatched, and taking past the last means all have.
    """

    def __init__(self, steps, on_finished: Callable[[int], None] | None = None, block_size: int = 1):
        super().__init__(steps)
        self.started = 0
        self._on_finished = on_finished
        self.block_size = block_size  # packed steps name written slots, block * bs + offset

    def __iter__(self) -> Iterator[HostStep]:
        for step in list.__iter__(self):
            self._finished()
            self.started += 1
            yield step
        self._finished()

    def _finished(self) -> None:
        if self.started and self._on_finished is not None:
            self._on_finished(self.started - 1)

    def written_blocks(self, source_rows: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
        """Per caller row, the sorted KV blocks the started steps write (their fill tables' entries)."""
        blocks: dict[int, set[int]] = {row: set() for row in source_rows}
        for step in list.__iter__(self[: self.started]):
            if isinstance(step.chunk, PackedStep):  # every row with a segment there, not only the source rows
                for segment in step.chunk.segments:
                    slots = step[PACKED_WRITE_SLOTS][segment.offset : segment.offset + segment.length]
                    blocks.setdefault(segment.row, set()).update((slots[slots >= 0] // self.block_size).tolist())
                continue
            # A hybrid step writes through every KV group's table (one block-id space: their union).
            tables = step[GROUP_FILL_TABLES].unbind(0) if GROUP_FILL_TABLES in step else (step[FILL_TABLE],)
            for table in tables:
                for row, entries in zip(source_rows, table[: len(source_rows)].tolist()):
                    blocks[row].update(b for b in entries if b >= 0)
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
