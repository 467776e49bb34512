"""``PrefillExecutor``: program/trace registries, warm-up, and eager or traced dispatch.

tt-metal's prefill runtime leaves this to a model executor; it is here so the
library is usable on its own. Rules:

* Warm-up from a ``WarmupManifest`` first runs every program signature
  eagerly where the backend builds programs per shape (on a device this
  compiles it; on the CPU nothing is built, so only the smallest runs, once:
  ``prefill_core.calls.warmup``), then allocates every alias workspace, then
  captures every trace signature, largest first. Nothing compiles or
  allocates after the first capture. Before it starts, ``on_progress`` gets
  stage ``"cost"`` whose detail is the ``WarmupCost``: the bodies, positions
  and persistent bytes the warm-up will take.
* Traced dispatch preflights the whole call: if any request lacks a trace or
  workspace, ``TraceCoverageError`` names the signature and the request
  before any model body runs. There is no silent eager fallback.
* Threads: the executor is its runtime's one caller at a time; warm-up and
  every stream hold the runtime (``PrefillRuntime.hold``), so an entry from
  another thread meanwhile raises ``PrefillStateError`` at once.
* ``mode``: ``prefill_core.ExecutionMode`` (``"traced"``, ``"eager"``, or
  ``"auto"``: traced when every request is covered, else eager), the same
  spelling as the runtime's; it also plans the call
  (``PrefillRuntime.prepare``). An eager run of a program signature the
  registry has not seen counts as a compile (``compile_count``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prefill_core import ExecutionMode, PrefillProgramSignature, WarmupManifest, execution_mode, replays
from prefill_core.calls.warmup import ModelGeometry, WarmupCost, aliases_to_allocate, programs_to_compile, warmup_cost
from prefill_core.values.errors import PrefillStateError
from prefill_shell.engine.call import PrefillCall, PrefillEntry
from prefill_shell.engine.call_guard import HeldStream
from prefill_shell.engine.progress import ProgressCallback, ProgressCounter
from prefill_shell.engine.result import BatchResult, InvocationResult, PrefillResult
from prefill_shell.engine.runtime import PrefillRuntime, PreparedBatch
from prefill_shell.engine.steps.trace import require_coverage

__all__ = ["PrefillExecutor"]


class PrefillExecutor(PrefillEntry):
    """Owns the program registry, the warm-up order and the eager-or-traced choice of one runtime."""

    def __init__(self, runtime: PrefillRuntime):
        self.runtime = runtime
        self.compiled: set[PrefillProgramSignature] = set()
        self.compile_count = 0
        self._closed = False

    # -- warm-up --------------------------------------------------------
    def compile(self, signature: PrefillProgramSignature) -> None:
        """Compiles ``signature`` once (an eager run that writes no KV)."""
        if signature in self.compiled:
            return
        self.runtime.compile(signature)
        self.compiled.add(signature)
        self.compile_count += 1

    @property
    def compiles_programs(self) -> bool:
        """Whether an eager run of a new shape builds a program on this runtime's backend."""
        return getattr(self.runtime.backend, "compiles_programs", True)

    def cost(self, manifest: WarmupManifest, *, capture: bool = True) -> WarmupCost:
        """What ``warm_up(manifest)`` (``capture=False``: ``compile_programs``) will run and keep, before it runs."""
        config = self.runtime.config
        spec, dtype = config.model.spec, config.model.dtype
        model = ModelGeometry(spec.hidden_size, spec.vocab_size, dtype.itemsize, config.policy.max_logprobs)
        bill = manifest if capture else WarmupManifest(manifest.program_signatures)
        return warmup_cost(bill, model, compiles_programs=self.compiles_programs)

    def compile_programs(self, manifest: WarmupManifest, on_progress: ProgressCallback | None = None) -> None:
        """The compile stage of ``warm_up`` alone (the plugin's ``enable_trace=False`` phase)."""
        self._check_open()
        ProgressCounter(on_progress, "cost", 0).start(str(self.cost(manifest, capture=False)))
        with self.runtime.hold():
            self._compile_stage(manifest, on_progress)

    def _compile_stage(self, manifest: WarmupManifest, on_progress) -> None:
        to_run = programs_to_compile(manifest, self.compiles_programs)
        # Where nothing is built per shape, a program is ready without a run: serving it is no late compile.
        self.compiled.update(s for s in manifest.program_signatures if s not in to_run)
        progress = ProgressCounter(on_progress, "compile", len(to_run)).start()
        for signature in to_run:
            self.compile(signature)
            progress.advance(signature.key)

    def warm_up(self, manifest: WarmupManifest, on_progress: ProgressCallback | None = None) -> None:
        """Compile every program (where the backend builds any), allocate every workspace, then capture every
        trace, largest first.

        ``on_progress`` gets stage ``"cost"`` (its detail the ``WarmupCost``),
        then ``"compile"``, ``"allocate"`` and ``"capture"`` in that order,
        each done 0..total (``prefill_shell.engine.progress``).
        """
        self._check_open()
        ProgressCounter(on_progress, "cost", 0).start(str(self.cost(manifest)))
        bodies = sorted(manifest.trace_signatures, key=lambda s: (s.padded_batch * s.chunk_length, s.key), reverse=True)
        stages = (
            ("allocate", aliases_to_allocate(manifest), self.runtime.allocate_workspace),
            ("capture", bodies, self.runtime.capture),
        )
        with self.runtime.hold():
            self._compile_stage(manifest, on_progress)
            for stage, signatures, run in stages:
                progress = ProgressCounter(on_progress, stage, len(signatures)).start()
                for signature in signatures:
                    run(signature)
                    progress.advance(signature.key)

    # -- dispatch -------------------------------------------------------
    def invocations(
        self,
        batch: PreparedBatch,
        mode: ExecutionMode | str = ExecutionMode.AUTO,
        on_progress: ProgressCallback | None = None,
    ) -> Iterator[InvocationResult]:
        """Invocations in plan order; a traced call is preflighted before anything runs.

        ``on_progress`` gets stage ``"prefill"``: done 0..``batch.num_steps`` body steps.
        """
        self._check_open()
        gaps = self.runtime.trace_gaps(batch)  # refuses anything but this runtime's PreparedBatch first
        mode = execution_mode(mode)
        if mode is ExecutionMode.TRACED:
            require_coverage(gaps)
        steps = self._run(batch, replays(mode, not gaps), on_progress)
        # Held until the stream ends (a replay's outputs stay unread between steps), advanced by its holder only.
        return HeldStream(self.runtime.hold, steps, "PrefillExecutor.invocations")

    def _run(self, batch: PreparedBatch, traced: bool, on_progress) -> Iterator[InvocationResult]:
        progress = ProgressCounter(on_progress, "prefill", batch.num_steps).start()
        for index, prepared in enumerate(batch.requests):
            self._check_open()  # a stream opened before close() must not outlive it
            if not traced and prepared.program_signature not in self.compiled:
                self.compiled.add(prepared.program_signature)
                self.compile_count += 1  # a program first seen while serving: a late compile
            run = ExecutionMode.TRACED if traced else ExecutionMode.EAGER
            yield self.runtime.invoke(batch, index, mode=run, progress=progress)

    def run(self, call: PrefillCall) -> list[PrefillResult] | BatchResult:
        """prepare + (traced or eager) invoke + streaming assemble of one call, in caller row order.

        ``PrefillEntry.prefill`` builds the call; with ``batched=True`` a row
        asking top or prompt log-probs raises ``InvalidSamplingError`` before
        anything runs.
        """
        with self.runtime.hold():
            return self.runtime.run(call, self.invocations)

    def close(self) -> None:
        """Closes its runtime (traces, workspaces, orphans: ``PrefillRuntime.close``); refuses further calls.

        An executor owns the runtime it drives, so closing one closes both,
        as ``LaneGroup.close`` closes every lane. Holds the runtime
        throughout: a close from another thread while a call runs is refused
        before it marks anything closed.
        """
        with self.runtime.hold():
            self._closed = True
            self.runtime.close()

    def _check_open(self) -> None:
        if self._closed:
            raise PrefillStateError("this PrefillExecutor was closed: its traces were released; build a new one")
