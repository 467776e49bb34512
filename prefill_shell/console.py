"""The console scripts' entry points: a missing extra is one ``error:`` line and exit status 2.

``pip install prefill-runtime`` without extras still puts ``prefill-run``,
``prefill-score`` and ``prefill-lm-eval`` on PATH. Their commands live in
``prefill_shell.cli``, which imports torch (and lm-eval) as it loads; this
module imports only the standard library and ``prefill_shell.extras``, loads
the command inside the check and reports a ``MissingExtraError`` (which
names the extra and its ``pip install`` line) as the other usage errors are
reported (``cli.args``), instead of a chained traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

from prefill_shell.extras import MissingExtraError

__all__ = ["lm_eval_main", "module_main", "run_main", "score_main"]


def _launch(module: str, function: str) -> None:
    try:
        command: Callable[[], None] = getattr(importlib.import_module(module), function)
        command()
    except MissingExtraError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def run_main() -> None:
    """``prefill-run``: ``python -m prefill_shell run`` with the same arguments."""
    _launch("prefill_shell.cli.main", "run_main")


def score_main() -> None:
    """``prefill-score``: ``python -m prefill_shell score`` with the same arguments."""
    _launch("prefill_shell.cli.main", "score_main")


def lm_eval_main() -> None:
    """``prefill-lm-eval``: lm-eval's command line with the ``prefill-runtime`` model registered."""
    _launch("prefill_shell.cli.lm_eval_harness", "main")


def module_main() -> None:
    """``python -m prefill_shell``."""
    _launch("prefill_shell.cli.main", "main")
