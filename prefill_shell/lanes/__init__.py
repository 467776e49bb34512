"""Data-parallel lanes: one executor per lane, rows routed by KV slot, results in source order.

``group`` holds ``LaneGroup`` (the routing and the combined result);
``dispatch`` runs the lanes' calls in turn or on threads.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch

from prefill_shell.lanes.group import LaneGroup

__all__ = ["LaneGroup"]
