"""Lines the ttnn tests report at the end of a run (``conftest.pytest_terminal_summary`` prints them)."""

from __future__ import annotations

LINES: list[str] = []


def note(line: str) -> None:
    """Adds one line to the ttnn section of the run's summary."""
    LINES.append(line)
