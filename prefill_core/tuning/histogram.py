"""Prompt-length histograms: the workload the ladder tuner (``tuner.py``) fits rungs to.

The file format is plain text, one entry per line::

    # comment lines and blank lines are ignored
    LENGTH [COUNT [CACHED]]

``LENGTH`` is a prompt length in tokens, ``COUNT`` how many prompts have it
(default 1) and ``CACHED`` how many of its leading tokens are already in the
KV cache (default: the ``--cached`` value, else 0). A length may appear on
several lines (with different cached prefixes, say); entries are rows
numbered from 0 in file order, which is how a planning error names them.
"""

from __future__ import annotations

import attrs

from prefill_core.values.errors import ArgumentError, InvalidCachedLengthError, PrefillInputError, field_error

__all__ = ["HistogramEntry", "parse_histogram", "histogram_text"]


def _at_least(minimum: int):
    def check(instance, attribute, value):
        if type(value) is not int or value < minimum:
            rule = f"must be an int >= {minimum}"
            raise field_error(PrefillInputError, "HistogramEntry", attribute.name, value, rule)

    return check


@attrs.frozen
class HistogramEntry:
    """``count`` prompts of ``length`` tokens, the first ``cached`` of them already cached.

    Checked on construction (a zero or negative count would make a cost of
    nothing, or a negative one, that the tuner would then prefer).
    """

    length: int = attrs.field(validator=_at_least(1))
    count: int = attrs.field(validator=_at_least(1))
    cached: int = attrs.field(validator=_at_least(0))

    def __attrs_post_init__(self):
        if self.cached > self.length:
            rule = f"must be <= length={self.length}"
            raise field_error(InvalidCachedLengthError, "HistogramEntry", "cached", self.cached, rule)

    @property
    def real_tokens(self) -> int:
        """Tokens these prompts must process (a fully cached prompt recomputes its last one)."""
        return self.count * max(self.length - self.cached, 1)


def _number(text: str, line: int, what: str, minimum: int) -> int:
    if not text.isdecimal() or int(text) < minimum:
        raise ArgumentError(f"line {line}: {what} {text!r} is not an integer >= {minimum}")
    return int(text)


def parse_histogram(text: str, *, block_size: int, cached: int = 0) -> tuple[HistogramEntry, ...]:
    """The entries of a histogram file's ``text``; ``cached`` fills in a missing CACHED column.

    That default is a shared prefix (a system prompt): an entry caches the
    whole blocks of ``min(cached, length - 1)`` tokens, so it always computes
    at least its last token. An explicit CACHED column is taken as written
    (the planner checks it, naming the entry's row).
    """
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 3:
            raise ArgumentError(f"line {number}: {raw.strip()!r} has more than LENGTH COUNT CACHED")
        length = _number(fields[0], number, "length", 1)
        count = _number(fields[1], number, "count", 1) if len(fields) > 1 else 1
        prefix = (
            _number(fields[2], number, "cached", 0)
            if len(fields) > 2
            else min(cached, length - 1) // block_size * block_size
        )
        if prefix > length:
            raise ArgumentError(f"line {number}: cached {prefix} exceeds the length {length}")
        entries.append(HistogramEntry(length, count, prefix))
    if not entries:
        raise ArgumentError("the histogram has no entries")
    return tuple(entries)


def histogram_text(entries: tuple[HistogramEntry, ...]) -> str:
    """``entries`` in the file format (``parse_histogram`` reads it back equal)."""
    return "".join(f"{e.length} {e.count} {e.cached}\n" for e in entries)
