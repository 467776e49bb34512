"""Option values every front end takes, checked one way: the command lines (``python -m prefill_core``,
``python -m prefill_shell run`` and ``score``) and lm-eval's ``--model_args``.

Each check takes the text (or value) the caller gave and returns the value,
or raises ``OptionError`` whose message is the rule alone; the front end
names its own flag (argparse: ``argument --block-size: '3' must be ...``,
exit 2; lm-eval: ``model argument block_size=3 is invalid: must be ...``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

__all__ = ["MAX_BLOCK_SIZE", "OptionError", "argparse_type", "block_size_option", "count_option"]

T = TypeVar("T")

MAX_BLOCK_SIZE = 512
"""The largest KV block size a front end takes: ``PrefillPolicy.fine_rungs`` needs ``4 * block_size`` to divide
its 2048-token max chunk."""


class OptionError(ValueError):
    """An option value breaks its rule; the message is the rule (``must be ...``)."""


def _integer(value: object) -> int:
    """An int, or a string of decimal digits (``isdigit`` also takes ``"²"``, which ``int`` refuses)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdecimal():
        return int(value)
    if type(value) is int:
        return value
    raise OptionError("must be an integer")


def count_option(value: object) -> int:
    """A count: an integer >= 1."""
    number = _integer(value)
    if number < 1:
        raise OptionError("must be an integer >= 1")
    return number


def block_size_option(value: object) -> int:
    """A KV block size: a power of two from 1 to ``MAX_BLOCK_SIZE``."""
    number = _integer(value)
    if not 1 <= number <= MAX_BLOCK_SIZE or number & (number - 1):
        raise OptionError(f"must be a power of two from 1 to {MAX_BLOCK_SIZE}")
    return number


def argparse_type(check: Callable[[str], T]) -> Callable[[str], T]:
    """``check`` as an argparse ``type``: its rule becomes argparse's usage error, which names the flag (exit 2)."""

    def parse(text: str) -> T:
        try:
            return check(text)
        except OptionError as error:
            raise argparse.ArgumentTypeError(f"{text!r} {error}") from None

    parse.__name__ = check.__name__.removesuffix("_option")  # argparse shows it in "invalid <name> value"
    return parse
