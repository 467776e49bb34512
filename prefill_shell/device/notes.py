"""``add_note``: attach a cleanup failure to the error in flight, on every declared Python.

``BaseException.add_note`` (PEP 678) arrived in Python 3.11; on 3.10, which
the package declares because ttnn ships wheels for it, calling it would raise
``AttributeError`` and replace the primary error. The fallback keeps the same
``__notes__`` list that 3.11+ tracebacks print, so callers read notes the
same way on every version.
"""

from __future__ import annotations

__all__ = ["add_note"]


def add_note(error: BaseException, note: str) -> None:
    """Appends ``note`` to ``error.__notes__`` without ever raising over ``error``."""
    if hasattr(error, "add_note"):
        error.add_note(note)
        return
    try:
        notes = error.__dict__.setdefault("__notes__", [])
    except AttributeError:  # an exception type with __slots__ and no __dict__: nothing to attach to
        return
    notes.append(note)
