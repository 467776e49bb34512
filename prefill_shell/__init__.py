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

Everything here needs the ``shell`` extra (torch, numpy, safetensors); a
missing one is named with its ``pip install`` line before anything else loads
(``prefill_shell.extras``).
"""

from prefill_shell.extras import requires_extra

with requires_extra("shell", "prefill_shell"):
    import numpy  # noqa: F401
    import safetensors  # noqa: F401
    import torch  # noqa: F401

from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.result import PrefillResult
from prefill_shell.engine.runtime import PrefillRuntime, PreparedBatch
from prefill_shell.lanes.group import LaneGroup

__all__ = [
    "LaneGroup",
    "PrefillExecutor",
    "PrefillResult",
    "PrefillRuntime",
    "PrefillRuntimeConfig",
    "PreparedBatch",
    "TorchBackend",
]
