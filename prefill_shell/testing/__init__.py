"""Testing tools shipped with the package, so users can run them on their own model or backend.

* ``FaultInjectingBackend`` / ``FaultInjectingModel``: fail the N-th device
  call of any kind, to prove ownership and cleanup under failure.
* ``PrefillLifecycleMachine``: a hypothesis state machine that interleaves
  prepare, eager and traced invocation, warm-up, layout changes, injected
  faults and cleanup, checking leaks, KV integrity and results after every
  step (``run_lifecycle_machine``).
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch

from .faults import FAULT_KINDS, FaultInjectingBackend, FaultInjectingModel, FaultPlan, InjectedFault

__all__ = ["FAULT_KINDS", "FaultInjectingBackend", "FaultInjectingModel", "FaultPlan", "InjectedFault"]
# The state machine imports hypothesis: prefill_shell.testing.stateful, on request.
