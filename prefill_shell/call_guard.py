"""One call at a time per runtime: the guard and the decorators that hold it.

A runtime owns one lane's device state, and a serving engine drives a lane
from one thread; an entry from a second thread while a call (or an
unfinished stream) is in progress is an engine bug, refused at once with
``PrefillStateError`` before anything runs (see ``PrefillRuntime``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

from prefill_core.errors import PrefillStateError

__all__ = ["CallGuard", "exclusive", "exclusive_stream"]


def _thread_name(ident: int | None) -> str:
    """The name of the live thread ``ident``, for the error message."""
    return next((t.name for t in threading.enumerate() if t.ident == ident), "another thread")


class CallGuard:
    """At most one call in progress per runtime; an entry from another thread meanwhile raises at once.

    Re-entrant on the holding thread (a stream's ``assemble`` pulls from its
    ``invocations``), and held by a suspended stream generator until it is
    exhausted or closed: its unread outputs live in buffers the next replay
    overwrites.

    The lock is the hold itself: the first entry takes it without waiting
    (``acquire(blocking=False)``), the last exit gives it back, so a second
    thread's entry fails in one C call instead of queueing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the holding thread's ident, set once the lock is held
        self._depth = 0

    def enter(self, what: str) -> None:
        """Takes the guard for the calling thread (again, if it holds it); raises if another thread does."""
        me = threading.get_ident()
        if self._owner == me:  # re-entry: only the holding thread ever finds its own ident here
            self._depth += 1
            return
        if not self._lock.acquire(blocking=False):
            msg = (f"PrefillRuntime.{what} was called on thread {threading.current_thread().name!r} while a "
                   f"call is in progress on thread {_thread_name(self._owner)!r}; a runtime serves one call at "
                   f"a time (one runtime per execution lane, driven by one thread): nothing was run")
            raise PrefillStateError(msg)
        self._owner, self._depth = me, 1

    def exit(self) -> None:
        """Gives back one level of the calling thread's hold."""
        if self._depth > 1:
            self._depth -= 1
            return
        self._owner, self._depth = None, 0
        self._lock.release()

    @contextlib.contextmanager
    def hold(self, what: str) -> Iterator[None]:
        self.enter(what)
        try:
            yield
        finally:
            self.exit()


def exclusive(method):
    """Runs ``method`` holding the runtime's call guard."""

    name = method.__name__

    @functools.wraps(method)
    def held(self, *args, **kwargs):
        guard = self._guard
        guard.enter(name)  # enter/exit, not a generator context manager: this runs on every runtime call
        try:
            return method(self, *args, **kwargs)
        finally:
            guard.exit()

    return held


def exclusive_stream(method):
    """Runs generator ``method`` holding the call guard from its first step until it ends or is closed."""

    @functools.wraps(method)
    def held(self, *args, **kwargs):
        with self._guard.hold(method.__name__):
            yield from method(self, *args, **kwargs)

    return held
