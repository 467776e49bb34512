"""``--dtype`` on the command lines: the argument, and the model loaded in the dtype it resolves to.

``float32`` (the default: results equal fp32 transformers), ``bfloat16``,
``float16``, ``auto`` (the checkpoint's dtype, as lm-eval's ``hf`` model
means it) or ``native`` (bfloat16 where the device computes it natively,
else float32); ``prefill_core.values.dtype`` holds the rules. The resolved dtype
and the reason are printed on stderr, so a run always says which it used.
"""

from __future__ import annotations

import argparse
import sys

from prefill_core.values.dtype import DTYPE_REQUESTS, DtypeChoice, canonical_dtype
from prefill_core.values.errors import InvalidDtypeError
from prefill_shell.reference import PagedLlama
from prefill_shell.reference.loading.text import load_model, model_dtype
from prefill_shell.reference.windows.hybrid import HybridLlama

__all__ = ["add_dtype_argument", "load_cli_model"]


def _dtype(text: str) -> str:
    try:
        return canonical_dtype(text, "--dtype")
    except InvalidDtypeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: {str(error).split(' is invalid: ', 1)[-1]}") from None


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        type=_dtype,
        default="float32",
        help=f"model dtype: one of {', '.join(DTYPE_REQUESTS)} (auto: the checkpoint's; native: bfloat16 where the "
        "device computes it natively, else float32; default float32)",
    )


def load_cli_model(args: argparse.Namespace) -> tuple[PagedLlama | HybridLlama, DtypeChoice]:
    """``args.model`` loaded on ``args.device`` in the dtype ``args.dtype`` resolves to, and that resolution.

    A folder transformers slides loads as a ``HybridLlama`` whose KV groups take ``args.block_size``-token blocks.
    """
    choice = model_dtype(args.model, args.dtype, args.device)
    print(f"[dtype] {choice.describe()}", file=sys.stderr, flush=True)
    model = load_model(args.model, dtype=choice.dtype, device=args.device, block_size=args.block_size)
    return model, choice
