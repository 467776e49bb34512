"""``PrefillSequenceRunner``: the eager chunk loop with failure-safe ownership.

Each chunk is staged, run through the model body, and its inputs released;
a non-final chunk's hidden output is released as soon as the next step no
longer needs it. On any failure every handle acquired so far is released,
the primary error propagates unchanged, and cleanup failures ride along as
notes (the release callback keeps failed releases as orphans).
"""

from __future__ import annotations

from collections.abc import Callable

from prefill_core import PreparedPrefill

from .backends.base import Backend
from .inputs import DeviceStep, HostStep, PrefillInputStager
from .ledger import DeviceTensor, Ownership
from .postprocess import PrefillPostprocessor, wave_params
from .result import InvocationResult

__all__ = ["PrefillSequenceRunner"]


class PrefillSequenceRunner:
    """Runs every chunk of a prepared request eagerly and finishes the last one."""

    def __init__(
        self,
        backend: Backend,
        stager: PrefillInputStager,
        postprocessor: PrefillPostprocessor,
        body: Callable[[DeviceStep], object],
        release: Callable[..., None],
    ):
        self.backend = backend
        self.stager = stager
        self.postprocessor = postprocessor
        self._body = body
        self._release = release

    def run(self, prepared: PreparedPrefill, steps: list[HostStep], seeds: tuple[int, ...]) -> InvocationResult:
        acquired: list[DeviceTensor] = []
        try:
            hidden = inputs = None
            for step in steps:
                if hidden is not None:
                    # A non-final chunk's output and last-token index are never read.
                    self._release([hidden, inputs.last_index])
                inputs = self.stager.stage(step, acquired)
                hidden = self.backend.adopt(self._body(inputs), "hidden", Ownership.INVOCATION)
                acquired.append(hidden)
                self._release([h for h in inputs.handles() if h is not inputs.last_index])
            outputs = self.postprocessor.finish(
                prepared.program_signature, wave_params(prepared), hidden, inputs.last_index, seeds, acquired
            )
        except BaseException as primary:
            self._release(acquired, primary=primary)
            raise
        kept = set(map(id, outputs.values()))
        self._release([h for h in acquired if id(h) not in kept])
        return InvocationResult(prepared, outputs, [h for h in acquired if id(h) in kept], seeds)
