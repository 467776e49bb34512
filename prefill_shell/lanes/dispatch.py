"""Running the lanes of one group call: in turn (issue every lane, then read) or on threads of their own.

A ``LaneCall`` is one lane's share of a call, already prepared and
preflighted; ``run_in_turn`` and ``run_on_threads`` run a call's lanes and
name a failing lane (``error.lane``, ``partial_writes`` in caller rows).
Why in turn is the default, and what each mode guarantees: docs/lanes.md
("Dispatch", "Failure").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import attrs

from prefill_shell.device.notes import add_note
from prefill_shell.engine.result import InvocationResult, PrefillResult
from prefill_shell.engine.runtime import PrefillRuntime, PreparedBatch

__all__ = ["LaneCall", "run_in_turn", "run_on_threads"]


@attrs.frozen(eq=False)
class LaneCall:
    """One lane's share of a group call: caller rows, lane slots, its runtime, prepared batch and stream."""

    lane: int
    source_rows: tuple[int, ...]
    runtime: PrefillRuntime
    batch: PreparedBatch
    stream: Iterator[InvocationResult]


def _caller_rows(call: LaneCall, results: Sequence[PrefillResult | None]) -> tuple[list[int], list[int]]:
    """``(completed, not completed)`` caller rows of ``call``, from its lane-local results so far."""
    done = [call.source_rows[i] for i, r in enumerate(results) if r is not None]
    left = [call.source_rows[i] for i, r in enumerate(results) if r is None]
    return done, left


def name_the_lane(error: BaseException, failed: LaneCall, calls: Sequence[LaneCall], results: dict) -> None:
    """Marks ``error`` with its lane, its partial writes in caller rows and every lane's row outcome."""
    partial = getattr(error, "partial_writes", None)
    try:
        error.lane = failed.lane
        if partial is not None:
            error.partial_writes = {failed.source_rows[row]: blocks for row, blocks in partial.items()}
    except AttributeError:  # an exception type without a __dict__: the note below still carries it
        pass
    lines = []
    for call in calls:
        done, left = _caller_rows(call, results[call.lane])
        lines.append(f"lane {call.lane}: caller rows {done} completed, rows {left} not completed")
    written = "" if partial is None else f"; its partial writes in caller rows: {getattr(error, 'partial_writes', {})}"
    add_note(
        error,
        f"lane group: lane {failed.lane} failed (caller rows {list(failed.source_rows)}){written}. "
        + "; ".join(lines)
        + ". Completed rows hold whole KV but their results are discarded; only the failing lane's pool "
        "may hold partial writes. Call cleanup() before the next call.",
    )


def _read(call: LaneCall, invocation: InvocationResult, results: dict) -> None:
    mine = results[call.lane]
    for result in call.runtime.stream((invocation,)):
        mine[result.row] = result


def _release_unread(unread: list[tuple[LaneCall, InvocationResult]], primary: BaseException) -> None:
    """Releases invocations issued but never read; a failure rides on ``primary`` as a note."""
    for call, invocation in unread:
        try:
            call.runtime.release(invocation.owned, primary=primary)
        except BaseException as failure:  # orphans stay with the runtime for cleanup()
            add_note(primary, f"cleanup: lane {call.lane}: releasing an unread invocation failed: {failure!r}")


def run_in_turn(calls: Sequence[LaneCall]) -> dict[int, list[PrefillResult]]:
    """Issues one invocation of every lane, then reads them back in lane order, until every lane is done."""
    results: dict[int, list] = {call.lane: [None] * call.batch.num_rows for call in calls}
    active, unread, current = list(calls), [], None
    try:
        while active:
            for call in active:
                current = call
                invocation = next(call.stream, None)
                if invocation is not None:
                    unread.append((call, invocation))
            active = [call for call, _ in unread]
            while unread:
                current, invocation = unread.pop(0)
                _read(current, invocation, results)
    except BaseException as error:
        name_the_lane(error, current, calls, results)
        _release_unread(unread, error)
        raise
    finally:
        for call in calls:
            call.stream.close()  # ends each executor stream and its hold on the runtime
    return results


def run_on_threads(calls: Sequence[LaneCall]) -> dict[int, list[PrefillResult]]:
    """Each lane assembles its stream on its own thread; waits for every lane, then raises the first failure."""
    results: dict[int, list] = {call.lane: [None] * call.batch.num_rows for call in calls}
    failures: dict[int, BaseException] = {}
    stopped = threading.Event()  # the caller gave up starting lanes: a lane that has not begun never begins

    def work(call: LaneCall) -> None:
        try:
            if stopped.is_set():
                return
            for result in call.runtime.stream(call.stream):
                results[call.lane][result.row] = result
        except BaseException as error:  # handed to the caller's thread; the worker ends quietly
            failures[call.lane] = error
        finally:
            call.stream.close()

    threads = [threading.Thread(target=work, args=(call,), name=f"prefill-lane-{call.lane}") for call in calls]
    try:
        for thread in threads:
            thread.start()
    except BaseException as interrupted:  # Ctrl-C while a start waits for its thread, or no thread to be had
        stopped.set()
        _join_all(threads)  # the lanes already running finish first, as after an interrupted wait
        for lane, failure in sorted(failures.items()):
            add_note(interrupted, f"lane group: lane {lane} failed too: {failure!r}")
        raise
    _join_all(threads)
    if failures:
        first = min(failures)
        primary = failures[first]
        for lane, other in sorted(failures.items()):
            if lane != first:
                add_note(primary, f"lane group: lane {lane} failed too: {other!r}")
        name_the_lane(primary, next(c for c in calls if c.lane == first), calls, results)
        raise primary
    return results


def _join_all(threads: list[threading.Thread]) -> None:
    """Joins every thread; an interrupt while waiting is re-raised only once every lane has stopped."""
    interrupted = None
    for thread in threads:
        while thread.is_alive():
            try:
                thread.join()
            except BaseException as error:  # e.g. Ctrl-C on the caller's thread: the lanes still finish
                interrupted = interrupted or error
    if interrupted is not None:
        raise interrupted
