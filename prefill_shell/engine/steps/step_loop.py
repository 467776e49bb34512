"""``PrefillStepLoop``: the one loop that runs every step of an invocation, eager or traced.

Both modes run the same loop, ``PrefillStepLoop.run(mode, signature,
params, steps, seeds)``: each step runs the model body over the step's
inputs, then the last step's hidden output is finished by the
postprocessor. What differs between the modes is a ``StepMode``:

=========  =========================================  =============================================
           eager (``EagerSteps``)                     traced (``trace.TracedSteps``)
=========  =========================================  =============================================
inputs     uploaded as new invocation-owned tensors    refreshed in place into the trace's inputs
body       the model body runs                        the captured trace replays
outputs    new invocation-owned tensors               assigned into the program alias's workspace
=========  =========================================  =============================================

Ownership: every handle the loop acquires is in ``owned`` from the moment
it exists, and is taken out of it before it is handed to the runtime's
release, so a release that fails (the runtime keeps it as an orphan) is
never released again here. A step's inputs go as soon as its body has been
dispatched; a non-final step's hidden output goes before the next step
stages anything. On any failure every handle still owned is released, the
primary error propagates unchanged, and cleanup failures ride along as
notes. A traced mode acquires nothing: its tensors belong to the trace and
the workspace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from prefill_core import PrefillProgramSignature
from prefill_shell.backends.base import Backend
from prefill_shell.device.contract import HIDDEN, LAST_TOKEN_INDEX, TensorSpec
from prefill_shell.device.ledger import DeviceTensor, Ownership
from prefill_shell.engine.steps.inputs import DeviceStep, HostStep, PrefillInputStager
from prefill_shell.engine.steps.partial_writes import StepLog
from prefill_shell.engine.steps.postprocess import PrefillPostprocessor

__all__ = ["EagerSteps", "PrefillStepLoop", "StepMode"]


class Workspace(Protocol):
    """Persistent outputs a traced step finishes into (``trace.AliasWorkspace``)."""

    tensors: dict[TensorSpec, DeviceTensor]


class StepMode(Protocol):
    """How one mode runs a step and where its outputs go."""

    workspace: Workspace | None
    """The program alias's persistent outputs (traced), or None: new invocation-owned outputs (eager)."""

    def run_step(self, step: HostStep, owned: list[DeviceTensor]) -> DeviceTensor:
        """Puts ``step``'s body inputs on the device and runs the body; returns its hidden output."""

    def last_token_index(self, step: HostStep, owned: list[DeviceTensor]) -> DeviceTensor:
        """The final step's last-token index on the device, for the postprocessor."""


class EagerSteps:
    """Eager mode: upload each step's inputs, run the model body, keep every output the invocation's own."""

    workspace = None

    def __init__(self, backend: Backend, stager: PrefillInputStager, body: Callable[[DeviceStep], object]):
        self._backend = backend
        self._stager = stager
        self._body = body

    def run_step(self, step: HostStep, owned: list[DeviceTensor]) -> DeviceTensor:
        inputs = self._stager.stage(step, owned)
        hidden = self._backend.adopt(self._body(inputs), HIDDEN, Ownership.INVOCATION)
        owned.append(hidden)
        return hidden

    def last_token_index(self, step: HostStep, owned: list[DeviceTensor]) -> DeviceTensor:
        handle = self._backend.upload(step[LAST_TOKEN_INDEX], LAST_TOKEN_INDEX, Ownership.INVOCATION)
        owned.append(handle)
        return handle


def _hand_off(owned: list[DeviceTensor], handles: list[DeviceTensor]) -> list[DeviceTensor]:
    """Removes ``handles`` from ``owned`` and returns them: the caller now owns them."""
    for handle in handles:
        owned.remove(handle)  # handles compare by identity
    return handles


class PrefillStepLoop:
    """Runs every step of one program in a ``StepMode`` and finishes the last one."""

    def __init__(self, postprocessor: PrefillPostprocessor, release: Callable[..., None]):
        self._postprocessor = postprocessor
        self._release = release

    def run(
        self,
        mode: StepMode,
        signature: PrefillProgramSignature,
        params: tuple,
        steps: Sequence[HostStep],
        seeds: tuple[int, ...],
        on_hidden: Callable[[object, int], None] | None = None,
        log: StepLog | None = None,
    ) -> tuple[dict[TensorSpec, DeviceTensor], list[DeviceTensor]]:
        """Runs ``steps`` and postprocesses the last; returns the outputs and the handles they keep alive.

        ``params`` are per physical row (``postprocess.wave_params``). ``on_hidden(hidden, i)``
        (prompt log-probs) sees step i's hidden output before the next step replaces it;
        what it allocates is its own and released by it. ``log`` hears each
        step start (before its body is dispatched) and finish.
        """
        owned: list[DeviceTensor] = []
        try:
            hidden = None
            for index, step in enumerate(steps):
                # The previous step's hidden output is never read again.
                self._release(_hand_off(owned, list(owned)))
                if log is not None:
                    log.step_started(index)
                hidden = mode.run_step(step, owned)
                if on_hidden is not None:
                    on_hidden(hidden.value, index)
                self._release(_hand_off(owned, [h for h in owned if h is not hidden]))
                if log is not None:
                    log.step_finished(index)
            last_index = mode.last_token_index(steps[-1], owned)
            finish = self._postprocessor.finish
            workspace = None if mode.workspace is None else mode.workspace.tensors
            outputs = finish(signature, params, hidden, last_index, seeds, owned, workspace=workspace)
            kept = {id(h) for h in outputs.values()}
            # Inside the try: an interrupt in this release must not strand the outputs.
            self._release(_hand_off(owned, [h for h in owned if id(h) not in kept]))
        except BaseException as primary:
            self._release(_hand_off(owned, list(owned)), primary=primary)
            raise
        return outputs, owned
