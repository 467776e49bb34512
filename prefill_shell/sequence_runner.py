"""``PrefillSequenceRunner``: the eager chunk loop with failure-safe ownership.

Each chunk is staged, run through the model body, and its inputs released;
a non-final chunk's hidden output is released as soon as the next step no
longer needs it. Every handle has exactly one owner at a time: a handle is
taken out of the invocation's list before it is handed to the runtime's
release, so a release that fails (the runtime keeps it as an orphan) is
never released again by this invocation. On any failure every handle still
owned is released, the primary error propagates unchanged, and cleanup
failures ride along as notes.
"""

from __future__ import annotations

from collections.abc import Callable

from prefill_core import PrefillProgramSignature

from .backends.base import Backend
from .contract import HIDDEN, LAST_TOKEN_INDEX, TensorSpec
from .inputs import DeviceStep, HostStep, PrefillInputStager
from .ledger import DeviceTensor, Ownership
from .postprocess import PrefillPostprocessor

__all__ = ["PrefillSequenceRunner"]


def _hand_off(owned: list[DeviceTensor], handles: list[DeviceTensor]) -> list[DeviceTensor]:
    """Removes ``handles`` from ``owned`` and returns them: the caller now owns them."""
    for handle in handles:
        owned.remove(handle)  # handles compare by identity: one C-level scan of a short list
    return handles


class PrefillSequenceRunner:
    """Runs every chunk of one program eagerly and finishes the last one."""

    def __init__(
        self,
        backend: Backend,
        stager: PrefillInputStager,
        postprocessor: PrefillPostprocessor,
        body: Callable[[DeviceStep], object],
        release: Callable[..., None],
    ):
        self._backend = backend
        self._stager = stager
        self._postprocessor = postprocessor
        self._body = body
        self._release = release

    def run(
        self,
        signature: PrefillProgramSignature,
        params: tuple,
        steps: list[HostStep],
        seeds: tuple[int, ...],
        on_hidden: Callable[[object, int], None] | None = None,
    ) -> tuple[dict[TensorSpec, DeviceTensor], list[DeviceTensor]]:
        """Runs ``steps`` and postprocesses the last; returns the outputs and the handles they keep alive.

        ``on_hidden(hidden, i)`` (prompt log-probs) sees each step's hidden output before it is released.
        """
        owned: list[DeviceTensor] = []
        try:
            hidden = inputs = None
            for index, step in enumerate(steps):
                if hidden is not None:
                    # A non-final chunk's output and last-token index are never read.
                    self._release(_hand_off(owned, [hidden, inputs[LAST_TOKEN_INDEX]]))
                inputs = self._stager.stage(step, owned)
                hidden = self._backend.adopt(self._body(inputs), HIDDEN, Ownership.INVOCATION)
                owned.append(hidden)
                if on_hidden is not None:
                    on_hidden(hidden.value, index)
                self._release(_hand_off(owned, [h for h in inputs.handles() if h is not inputs[LAST_TOKEN_INDEX]]))
            outputs = self._postprocessor.finish(signature, params, hidden, inputs[LAST_TOKEN_INDEX], seeds, owned)
            kept = set(map(id, outputs.values()))
            # Inside the try: an interrupt in this release must not strand the outputs.
            self._release(_hand_off(owned, [h for h in owned if id(h) not in kept]))
        except BaseException as primary:
            self._release(_hand_off(owned, list(owned)), primary=primary)
            raise
        return outputs, owned
