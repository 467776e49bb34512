"""The command line's arguments, checked as they are parsed, and the one line a failure prints.

A usage problem (an unknown flag, a value of the wrong form, a device this
process cannot use) exits with status 2; anything else that fails (a file, a
model, a prompt) exits with status 1. Either way stderr gets exactly one
``error:`` line naming the argument, file or prompt and what to do; the
traceback appears only with ``--debug``.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from prefill_core.values.errors import PrefillError
from prefill_shell.cli import options
from prefill_shell.cli.model_dtype import add_dtype_argument
from prefill_shell.cli.pooling import add_pooling_parsers
from prefill_shell.cli.score import add_score_parser
from prefill_shell.reference.loading.text import PromptError

__all__ = ["build_parser", "failure_message"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``error:`` line (with where to get help) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """``python -m prefill_shell run``, ``score`` (``score_cli``), ``embed`` and ``rerank`` (``cli.pooling``)."""
    parser = _Parser(prog="python -m prefill_shell")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="prefill prompts (or, without any, the demo batch) and print next tokens")
    run.add_argument(
        "--model",
        type=options.model,
        help="a GGUF file, a Hugging Face folder, or random:NAME (default: the pinned SmolLM2)",
    )
    run.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    run.add_argument(
        "--prompts",
        action="append",
        metavar="FILE",
        help="a file: one prompt per line, or JSON lines (suffix .jsonl/.ndjson in any case, or a first line "
        "that is an object) with 'prompt' or chat 'messages' (repeatable: every file is read)",
    )
    run.add_argument(
        "--token-ids",
        action="append",
        metavar="FILE",
        help="a file of prompts as space-separated token ids, one per line (repeatable)",
    )
    run.add_argument("--chat", action="store_true", help="apply the model's chat template to plain prompts")
    run.add_argument("--device", default="cpu", type=options.device, help="torch device (cpu or cuda)")
    add_dtype_argument(run)
    run.add_argument("--block-size", type=options.block_size, default=32, help="KV block size (a power of two)")
    run.add_argument("--seed", type=options.seed, default=0, help="sampling seed (row i samples with seed + i)")
    run.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    add_score_parser(sub)
    add_pooling_parsers(sub)
    return parser


def failure_message(error: BaseException) -> str:
    """The text after ``error:`` for a failure while running, on one line (the library's message where it has one)."""
    return " ".join(_message(error).split())


def _message(error: BaseException) -> str:
    if isinstance(error, (PromptError, PrefillError)):
        return str(error)
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}: check the path and its permissions"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, MemoryError):
        return "out of memory: use fewer or shorter prompts, or a smaller model"
    return f"unexpected {type(error).__name__}: {error} (rerun with --debug for the traceback and report it)"
