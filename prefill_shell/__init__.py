"""Imperative shell of the prefill runtime: every device touch lives here.

The public entry points, re-exported: ``PrefillRuntimeConfig`` (validated
static collaborators), ``PrefillRuntime`` (prepare, invoke, assemble,
cleanup), ``PrefillExecutor`` (warm-up and traced dispatch), ``LaneGroup``
(data-parallel lanes routed by slot), ``TorchBackend``, and the ``PrefillResult`` value. ``TtnnBackend`` is in
``prefill_shell.tt.backend`` and imported only on request.
"""

from .backends import TorchBackend
from .config import PrefillRuntimeConfig
from .executor import PrefillExecutor
from .lane_group import LaneGroup
from .result import PrefillResult
from .runtime import PrefillRuntime, PreparedBatch

__all__ = [
    "LaneGroup",
    "PrefillExecutor",
    "PrefillResult",
    "PrefillRuntime",
    "PrefillRuntimeConfig",
    "PreparedBatch",
    "TorchBackend",
]
