"""Optional packages: an import that needs an extra says which one installs it.

``prefill_core`` needs only attrs and cattrs; everything else comes from an
extra of ``pyproject.toml`` (``shell``: torch, numpy, safetensors; ``tt``: the
shell and, on the Pythons ttnn has wheels for, ttnn with its ``numpy<2``;
``text``: transformers, gguf; ``testing``: hypothesis; ``lm-eval``: lm-eval). Each import of one sits in a
``requires_extra`` block, so a user missing it reads the ``pip install`` line
that fixes it, or, on a Python the extra skips the package on, which Pythons
it has. The wheel test (``tests/test_wheel.py``) imports every module with
each extra's packages refused in turn and checks exactly this.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from prefill_core.values.errors import PrefillConfigError

__all__ = ["LM_EVAL_PYTHONS", "TTNN_EXTRA", "TTNN_PYTHONS", "MissingExtraError", "require_shell", "requires_extra"]

TTNN_PYTHONS = ("3.10", "3.12")
"""The CPythons ttnn 0.81.1 ships wheels for (the ``tt`` extra's ttnn marker)."""

TTNN_EXTRA = "tt"
"""The extra that installs ttnn (the ``shell`` extra is torch only: no Tenstorrent stack, no ``numpy<2``)."""

LM_EVAL_PYTHONS = ("3.12",)
"""The CPython the ``lm-eval`` extra installs lm-eval on (its tests run there only)."""


class MissingExtraError(PrefillConfigError, ModuleNotFoundError):
    """An optional package is missing: names what needs it, the package, the extra and, when limited, its Pythons.

    A ``PrefillConfigError`` (the command lines report it in one line) and a
    ``ModuleNotFoundError`` (``except ImportError`` still catches it; ``name`` is the module).
    """

    def __init__(self, needed_by: str, module: str | None, extra: str, pythons: tuple[str, ...] = ()):
        running = f"{sys.version_info[0]}.{sys.version_info[1]}"
        install = f"pip install 'prefill-runtime[{extra}]'"
        msg = f"{needed_by} needs {module}, which the '{extra}' extra installs"
        if pythons and running not in pythons:
            msg += f" on CPython {' and '.join(pythons)} only; this is CPython {running}: {install} on one of those"
        elif pythons:
            msg += f" (on CPython {' and '.join(pythons)}): {install}"
        else:
            msg += f": {install}"
        super().__init__(msg)
        self.name = module  # ImportError's field; ValueError's __init__ (first in the MRO) takes no keywords
        self.extra = extra
        self.pythons = pythons


@contextlib.contextmanager
def requires_extra(extra: str, needed_by: str, *, pythons: tuple[str, ...] = ()) -> Iterator[None]:
    """Imports inside come from ``extra``: a missing one raises ``MissingExtraError`` naming it.

    ``needed_by`` is what asked (a module name, "the ttnn backend"); ``pythons``
    the CPythons the extra installs the package on, when it does not on all.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        if isinstance(exc, MissingExtraError):
            raise
        raise MissingExtraError(needed_by, exc.name, extra, pythons) from exc


def require_shell(needed_by: str) -> None:
    """Imports the ``shell`` extra's packages (numpy, safetensors, torch); a missing one is a ``MissingExtraError``.

    Every subpackage of ``prefill_shell`` calls it first, so any module of the
    shell names the extra before its own ``import torch`` would fail raw; the
    package root and ``prefill_shell.console`` do not, so a console script can
    report a missing extra in one line.
    """
    with requires_extra("shell", needed_by):
        import numpy  # noqa: F401
        import safetensors  # noqa: F401
        import torch  # noqa: F401
