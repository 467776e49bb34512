"""One call at a time per runtime: the guard and the decorators that hold it.

A runtime owns one lane's device state, and a serving engine drives a lane
from one thread; an entry from a second thread while a call (or an
unfinished stream) is in progress is an engine bug, refused at once with
``PrefillStateError`` before anything runs (see ``PrefillRuntime``).
A stream holds the guard from its first step until it ends or is closed, and
is advanced only on the thread that started it (``HeldStream``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prefill_core.values.errors import PrefillStateError

__all__ = ["CallGuard", "HeldStream", "exclusive", "exclusive_stream"]


class CallGuard:
    """At most one call in progress per runtime; an entry from another thread meanwhile raises at once.

    The lock is the hold itself: the outermost entry takes it without
    waiting (``acquire(blocking=False)``), so a second thread's entry fails
    in one C call instead of queueing. Entries on the holding thread are
    re-entrant (a stream's ``assemble`` pulls from its ``invocations``).
    ``depth`` counts the holds open on that thread (``hold()`` blocks,
    stream generators, the outermost call); the lock goes back when the last
    one closes, so a suspended stream generator keeps the runtime held
    until it is exhausted or closed: its unread outputs live in buffers the
    next replay overwrites.
    """

    def __init__(self, owner: str = "PrefillRuntime") -> None:
        self.owner_name = owner  # what a refusal names: the class whose call is in progress
        self.lock = threading.Lock()
        self.owner: int | None = None  # the holding thread's ident, set once the lock is held
        self.depth = 0

    def refusal(self, what: str) -> PrefillStateError:
        """The error for an entry into ``what`` while another thread holds the guard."""
        holder = next((t.name for t in threading.enumerate() if t.ident == self.owner), "another thread")
        return PrefillStateError(
            f"{self.owner_name}.{what} was called on thread {threading.current_thread().name!r} while a call is in "
            f"progress on thread {holder!r}; a runtime serves one call at a time (one runtime per execution "
            f"lane, driven by one thread): nothing was run"
        )

    def enter(self, what: str) -> None:
        """Opens one hold for the calling thread; raises if another thread holds the guard."""
        me = threading.get_ident()
        if self.owner != me:
            if not self.lock.acquire(blocking=False):
                raise self.refusal(what)
            self.owner = me
        self.depth += 1

    def exit(self) -> None:
        """Closes one hold; the last one gives the lock back."""
        self.depth -= 1
        if not self.depth:
            self.owner = None
            self.lock.release()

    @contextlib.contextmanager
    def hold(self, what: str) -> Iterator[None]:
        """One hold for the body of a ``with`` block (``what`` names the entry in a refusal)."""
        self.enter(what)
        try:
            yield
        finally:
            self.exit()


def exclusive(method):
    """Runs ``method`` holding the runtime's call guard (re-entrant on the holding thread)."""

    @functools.wraps(method)
    def held(self, *args, **kwargs):
        with self._guard.hold(method.__name__):
            return method(self, *args, **kwargs)

    return held


class HeldStream:
    """A stream that holds the runtime from its first step until it ends or is closed; only its holder advances it.

    ``hold()`` opens the hold (``CallGuard.hold`` or ``PrefillRuntime.hold``)
    on the thread that takes the first step. Not a generator on purpose: a
    generator that raises is finished, so a refusal raised inside one would
    end its holder's stream (and let the hold go) for another thread's
    ``next()``. Here that ``next()`` is refused before the stream resumes:
    nothing runs and the stream goes on for its holder. ``close()`` works from
    any thread; a stream dropped unfinished is closed when it is freed.
    """

    def __init__(self, hold: Callable[[], contextlib.AbstractContextManager[Any]], steps: Iterator, name: str):
        self._hold = hold
        self._steps = steps
        self.name = name
        self._held: contextlib.ExitStack | None = None
        self._holder: threading.Thread | None = None
        self._ended = False

    def __iter__(self) -> HeldStream:
        return self

    def __next__(self):
        if self._ended:
            raise StopIteration
        if self._held is None:
            held = contextlib.ExitStack()
            held.enter_context(self._hold())  # refused here when another thread holds the runtime
            self._held, self._holder = held, threading.current_thread()
        elif self._holder is not threading.current_thread():
            raise PrefillStateError(
                f"{self.name}: next() on thread {threading.current_thread().name!r} was refused: a stream is "
                f"advanced only on the thread that started it ({self._holder.name!r}); nothing was run and the "
                "stream goes on there"
            )
        try:
            return next(self._steps)
        except BaseException:  # the stream ended (exhausted or failed), as a generator's would
            self._end()
            raise

    def close(self) -> None:
        """Ends the stream and lets its hold go (from any thread)."""
        if self._ended:
            return
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()  # raises while the holder is inside a step: the hold stays with it
        self._end()

    def _end(self) -> None:
        self._ended = True
        held, self._held = self._held, None
        if held is not None:
            held.close()

    def __del__(self) -> None:
        if hasattr(self, "_ended"):
            self.close()


def exclusive_stream(method):
    """Wraps a method that returns a stream: the stream holds the runtime's call guard from its first step until
    it ends or is closed (``HeldStream``)."""

    @functools.wraps(method)
    def held(self, *args, **kwargs):
        name = f"{self._guard.owner_name}.{method.__name__}"
        return HeldStream(lambda: self._guard.hold(method.__name__), method(self, *args, **kwargs), name)

    return held
