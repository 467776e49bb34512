"""Where the pinned real model lives: SmolLM2-135M-Instruct (Q4_1 GGUF).

``scripts/ensure-model.sh`` (run by ``make model``, ``make demo`` and
``make test``) fetches it once into the user cache and the Makefile passes
its path as ``PREFILL_SMOLLM2``. Nothing here touches the network: a missing
file or one whose sha256 differs from the pinned digest is a named error
that says how to get the right file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from prefill_core.values.errors import PrefillConfigError

__all__ = [
    "ENV_VAR",
    "FILE_NAME",
    "SHA256",
    "ModelChecksumError",
    "ModelFileMissingError",
    "check_sha256",
    "default_path",
    "smollm2_path",
]

ENV_VAR = "PREFILL_SMOLLM2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_FETCH_HINT = "run `make model` (scripts/ensure-model.sh) to fetch it"

_verified: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) already hashed in this process


class ModelFileMissingError(PrefillConfigError, FileNotFoundError):
    """The pinned model file is not where the environment or the cache says."""


class ModelChecksumError(PrefillConfigError):
    """The pinned model file exists but is not the pinned bytes."""


def default_path() -> Path:
    """The cache path scripts/ensure-model.sh writes (same variables, same order)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = Path(os.environ.get("PREFILL_VENV_ROOT") or cache / "prefill-runtime")
    return Path(os.environ.get("PREFILL_MODEL_DIR") or root / "models") / FILE_NAME


def smollm2_path(verify: bool = True) -> Path:
    """The pinned GGUF file: ``$PREFILL_SMOLLM2``, else the cache path.

    Raises ``ModelFileMissingError`` when the file is absent and
    ``ModelChecksumError`` when ``verify`` and its sha256 is not the pinned one.
    """
    path = Path(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else default_path()
    if not path.is_file():
        msg = f"the SmolLM2 model file {path} does not exist: {_FETCH_HINT}"
        raise ModelFileMissingError(msg)
    if verify:
        check_sha256(path)
    return path


def check_sha256(path: Path, expected: str = SHA256) -> None:
    """Raises ``ModelChecksumError`` unless ``path``'s bytes hash to ``expected``."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _verified:
        return
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    actual = digest.hexdigest()
    if actual != expected:
        msg = f"{path} has sha256 {actual}, expected {expected}: delete it and {_FETCH_HINT}"
        raise ModelChecksumError(msg)
    _verified.add(key)
