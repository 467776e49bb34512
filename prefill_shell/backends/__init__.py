"""Backends: the device operations the runtime needs, on torch or ttnn.

``TtnnBackend`` lives in ``prefill_shell.tt.backend`` and is
imported only on request, so nothing on the torch path imports ttnn.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch

from .base import Backend, TraceHandle
from .torch_backend import TorchBackend

__all__ = ["Backend", "TorchBackend", "TraceHandle"]
