"""The argparse types of ``python -m prefill_shell run`` and ``score``: one check per option for both commands.

Counts and block sizes are ``prefill_core.inputs.options``' checks (the core's
command line and lm-eval's model arguments use them too); the device is
checked by building the torch backend on it, so ``--device foo`` and
``--device cuda`` without CUDA are usage errors that name the flag (exit 2).
"""

from __future__ import annotations

import argparse

from prefill_core.inputs.options import argparse_type, block_size_option, count_option
from prefill_core.values.errors import PrefillError
from prefill_shell.backends import TorchBackend

__all__ = ["MAX_SEED", "block_size", "count", "device", "model", "seed"]

MAX_SEED = 2**62  # each row samples with seed + row, which must stay below 2**63

count = argparse_type(count_option)
block_size = argparse_type(block_size_option)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def seed(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer from 0 to 2**62")
    return value


def model(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a GGUF file, a Hugging Face folder or random:NAME")
    return text


def device(text: str) -> str:
    try:
        TorchBackend(text)
    except PrefillError as error:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be used: {str(error).split(': ', 1)[-1]}") from None
    return text
