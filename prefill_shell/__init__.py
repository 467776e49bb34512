"""Imperative shell of the prefill runtime: every device touch lives here.

One subpackage per import layer, top to bottom (``docs/design.md`` has the
map and the contracts ``make lint-imports`` checks):

- ``cli``: the command lines.
- ``serving`` (vLLM plugin facades) and ``scoring`` (evals, lm-eval), independent of each other.
- ``lanes``: data-parallel lanes over executors.
- ``engine``: ``PrefillRuntime``, ``PrefillExecutor`` and their private ``engine.steps``.
- ``backends`` (torch; ``tt`` holds the ttnn one), ``sampling``, ``device`` (contract, model protocol, ledger).

``reference`` (the torch paged-KV model and its loaders) and ``tt`` (ttnn
backend, adapter, golden-op emulation) implement the device layer's
protocols; ``testing`` ships fault injection and a stateful test for any
model and backend.

Re-exported here: ``PrefillRuntimeConfig``, ``PrefillRuntime``,
``PreparedBatch``, ``PrefillExecutor``, ``LaneGroup``, ``TorchBackend`` and the
``PrefillResult`` value. ``TtnnBackend`` is in ``prefill_shell.tt.backend`` and
imported only on request.

Everything here but ``extras`` and ``console`` needs the ``shell`` extra
(torch, numpy, safetensors): each subpackage names it with its ``pip
install`` line before anything else loads (``extras.require_shell``), and the
re-exports load on first use, so the console scripts (``console``) can say
so in one line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from prefill_shell.extras import require_shell

if TYPE_CHECKING:
    from prefill_shell.backends import TorchBackend
    from prefill_shell.engine.config import PrefillRuntimeConfig
    from prefill_shell.engine.executor import PrefillExecutor
    from prefill_shell.engine.result import PrefillResult
    from prefill_shell.engine.runtime import PrefillRuntime, PreparedBatch
    from prefill_shell.lanes.group import LaneGroup

_HOMES = {
    "LaneGroup": "prefill_shell.lanes.group",
    "PrefillExecutor": "prefill_shell.engine.executor",
    "PrefillResult": "prefill_shell.engine.result",
    "PrefillRuntime": "prefill_shell.engine.runtime",
    "PrefillRuntimeConfig": "prefill_shell.engine.config",
    "PreparedBatch": "prefill_shell.engine.runtime",
    "TorchBackend": "prefill_shell.backends",
}

__all__ = [
    "LaneGroup",
    "PrefillExecutor",
    "PrefillResult",
    "PrefillRuntime",
    "PrefillRuntimeConfig",
    "PreparedBatch",
    "TorchBackend",
]


def __getattr__(name: str):
    """A re-export, imported on first use (``MissingExtraError`` without the ``shell`` extra)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'prefill_shell' has no attribute {name!r}")
    require_shell("prefill_shell")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
