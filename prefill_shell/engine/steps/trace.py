"""``PrefillTraceLifecycle``: capture, persistent inputs, alias workspaces, and the traced step mode.

A trace is the sampling-free hidden body of one ``PrefillTraceSignature``
over persistent inputs (one per ``contract.BODY_INPUTS`` entry it reads),
refreshed in place before each replay; ``TracedSteps`` (from ``mode_for``)
is the step loop's traced mode, finishing the final step into the program
alias's workspace (``contract.workspace_specs``). Why one trace serves every
request of its geometry, and who owns what: docs/design.md ("The request
path", "Ownership and failure"); an invocation's lifetime as a caller sees
it: docs/usage.md ("The rules of a call"). Only the runtime calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from prefill_core import PrefillProgramSignature, PrefillTraceSignature, PreparedPrefill
from prefill_core.calls.call_plan import LaneTraces, trace_gap, workspace_key
from prefill_core.values.errors import CleanupError, TraceCoverageError
from prefill_shell.backends.base import Backend, TraceHandle
from prefill_shell.device.contract import (
    BODY_INPUTS,
    FILL_TABLE,
    GROUP_FILL_TABLES,
    GROUP_READ_TABLES,
    GROUPED_INPUTS,
    HIDDEN,
    LAST_TOKEN_INDEX,
    READ_TABLE,
    SAMPLING_INPUTS,
    SLOTS,
    STEP_INPUTS,
    TensorSpec,
    body_geometry,
    program_geometry,
    workspace_specs,
)
from prefill_shell.device.ledger import DeviceTensor, Ownership
from prefill_shell.engine.steps.inputs import DeviceStep, HostStep, PrefillInputStager
from prefill_shell.engine.steps.postprocess import PrefillPostprocessor

__all__ = [
    "AliasWorkspace",
    "CapturedTrace",
    "PrefillTraceLifecycle",
    "TracedSteps",
    "require_coverage",
    "warmup_step",
]

# Entries that make a step write nothing: no KV block, no slot.
_NO_WRITE = {FILL_TABLE: -1, GROUP_FILL_TABLES: -1, SLOTS: -1}
# A workspace's K, P and T start as the greedy triple (K=1, P=1, T=1): zeros
# are no valid sampling values (a device stages T as 1/T), and every
# postprocess refreshes them before reading.
_WORKSPACE_START = dict.fromkeys(SAMPLING_INPUTS, 1)


class CapturedTrace:
    """One captured hidden body with its persistent inputs and output."""

    __slots__ = ("signature", "inputs", "hidden", "handle", "replays")

    def __init__(self, signature: PrefillTraceSignature, inputs: DeviceStep, hidden: DeviceTensor, handle: TraceHandle):
        self.signature = signature
        self.inputs = inputs
        self.hidden = hidden
        self.handle = handle
        self.replays = 0


class AliasWorkspace:
    """One program alias's persistent postprocessing tensors (``tensors``, by spec), and whose outputs they hold.

    ``generation`` counts the traced invocations finished into it; an
    invocation keeps the generation it claimed and is readable only while
    that is still the workspace's (``InvocationResult.check_readable``).
    ``released``: its tensors went back (``release_all``).
    """

    __slots__ = ("tensors", "generation", "released")

    def __init__(self) -> None:
        self.tensors: dict[TensorSpec, DeviceTensor] = {}
        self.generation = 0
        self.released = False

    def claim(self) -> int:
        """A new invocation is about to write every output: earlier ones are no longer readable."""
        self.generation += 1
        return self.generation


class TracedSteps:
    """The traced ``StepMode``: refresh the trace's persistent inputs, replay it, finish into the alias workspace."""

    def __init__(self, backend: Backend, stager: PrefillInputStager, trace: CapturedTrace, workspace: AliasWorkspace):
        self._backend = backend
        self._stager = stager
        self._trace = trace
        self.workspace = workspace

    def run_step(self, step: HostStep, owned: list[DeviceTensor]) -> DeviceTensor:
        self._stager.refresh(step, self._trace.inputs)
        self._backend.replay(self._trace.handle)
        self._trace.replays += 1
        return self._trace.hidden

    def last_token_index(self, step: HostStep, owned: list[DeviceTensor]) -> DeviceTensor:
        target = self.workspace.tensors[LAST_TOKEN_INDEX]
        self._backend.refresh(step[LAST_TOKEN_INDEX], target)
        return target


def require_coverage(gaps: Sequence[tuple[PreparedPrefill, str]]) -> None:
    """Raises ``TraceCoverageError`` naming the first request of a traced call that cannot be replayed.

    ``gaps``: each uncovered request with ``PrefillTraceLifecycle.gap``'s
    reason, for the whole call, so the call is refused before any request runs.
    """
    if gaps:
        prepared, why = gaps[0]
        raise TraceCoverageError(
            f"traced prefill of rows {prepared.request.source_rows} is not covered: {why}; program "
            f"{prepared.program_signature.key}; warm up a manifest that holds it or run it eagerly: nothing was run"
        )


def warmup_step(body: PrefillTraceSignature, hidden_size: int) -> HostStep:
    """A step of ``body``'s geometry that writes no KV: zero tokens, every fill entry and slot -1."""
    geometry = body_geometry(body, hidden_size)
    values = {}
    grouped = bool(body.groups)  # a hybrid body reads its groups' tables, not the single ones
    for spec in STEP_INPUTS:
        if spec in GROUPED_INPUTS and not grouped or spec in (FILL_TABLE, READ_TABLE) and grouped:
            continue
        if spec is READ_TABLE and not body.read_table_width or spec is GROUP_READ_TABLES and not geometry["Wgr"]:
            continue
        values[spec] = torch.full(spec.shape(geometry), _NO_WRITE.get(spec, 0), dtype=spec.host_dtype)
    return HostStep(None, values, body.variant)


class PrefillTraceLifecycle:
    """Captures traces, keeps per-alias workspaces, and replays prepared requests."""

    def __init__(
        self,
        backend: Backend,
        stager: PrefillInputStager,
        postprocessor: PrefillPostprocessor,
        body: Callable[[DeviceStep], object],
        model_spec,
        model_dtype: torch.dtype,
        release: Callable[..., None],
    ):
        self._backend = backend
        self._stager = stager
        self._postprocessor = postprocessor
        self._body = body
        self._spec = model_spec
        self._dtype = model_dtype
        self._release = release
        self.traces: dict[PrefillTraceSignature, CapturedTrace] = {}
        self.workspaces: dict[tuple, AliasWorkspace] = {}

    def allocate_workspace(self, signature: PrefillProgramSignature) -> None:
        """Persistent postprocessing tensors of one program alias (warm-up only)."""
        key = workspace_key(signature)
        if key in self.workspaces:
            return
        geometry = program_geometry(
            signature, self._spec.hidden_size, self._spec.vocab_size, self._postprocessor.max_logprobs
        )
        workspace = AliasWorkspace()
        try:
            for spec in workspace_specs(signature):
                start = torch.full(spec.shape(geometry), _WORKSPACE_START.get(spec, 0), dtype=spec.dtype(self._dtype))
                workspace.tensors[spec] = self._backend.upload(start, spec, Ownership.WORKSPACE)
        except BaseException as primary:
            self._release(list(workspace.tensors.values()), primary=primary)
            raise
        self.workspaces[key] = workspace

    def capture(self, body_signature: PrefillTraceSignature) -> CapturedTrace:
        """Allocates the persistent inputs and output of ``body_signature`` and captures it."""
        if body_signature in self.traces:
            return self.traces[body_signature]
        step = warmup_step(body_signature, self._spec.hidden_size)
        inputs = DeviceStep(body_signature.variant)
        hidden = None
        try:
            for spec in BODY_INPUTS:
                if spec in step:
                    inputs[spec] = self._backend.upload(step[spec], spec, Ownership.TRACE)
            geometry = body_geometry(body_signature, self._spec.hidden_size)
            hidden_host = torch.zeros(HIDDEN.shape(geometry), dtype=HIDDEN.dtype(self._dtype))
            hidden = self._backend.upload(hidden_host, HIDDEN, Ownership.TRACE)

            def replay_body() -> None:
                self._backend.assign(hidden, self._body(inputs))

            handle = self._backend.capture(body_signature.key, replay_body)
        except BaseException as primary:
            # A failed capture leaves nothing behind: its buffers go back now.
            self._release(inputs.handles() + ([hidden] if hidden is not None else []), primary=primary)
            raise
        trace = CapturedTrace(body_signature, inputs, hidden, handle)
        self.traces[body_signature] = trace
        return trace

    def lane_traces(self) -> LaneTraces:
        """What this lane has captured, as the core plans with it (``prefill_core.LaneTraces``)."""
        return LaneTraces(frozenset(self.traces), frozenset(self.workspaces))

    def gap(self, prepared: PreparedPrefill) -> str | None:
        """Why ``prepared`` cannot be replayed, or None when it can (the core's ``trace_gap``, on this lane's
        registries as they are: nothing is copied per request)."""
        return trace_gap(prepared, self.traces, self.workspaces)

    def mode_for(self, prepared: PreparedPrefill) -> tuple[TracedSteps, int]:
        """The traced step mode of ``prepared`` and the workspace generation it claimed.

        Raises ``TraceCoverageError`` when ``prepared`` cannot be replayed,
        before anything runs. The claim makes every earlier invocation of
        the same alias unreadable: this one is about to overwrite its outputs.
        """
        why = self.gap(prepared)
        if why is not None:
            require_coverage([(prepared, why)])
        trace = self.traces[prepared.trace_signature]
        workspace = self.workspaces[workspace_key(prepared.program_signature)]
        return TracedSteps(self._backend, self._stager, trace, workspace), workspace.claim()

    def release_all(self) -> None:
        """Releases every trace, its persistent tensors, and every workspace.

        A trace whose release fails keeps its buffers (the device may still
        reference them) and stays registered, so a later call retries it;
        ``CleanupError`` reports it.
        """
        failures = []
        for signature, trace in list(self.traces.items()):
            if not trace.handle.released:
                try:
                    self._backend.release_trace(trace.handle)
                except Exception as failure:
                    failures.append(f"{signature.key}: {failure!r}")
                    continue
            self._release(trace.inputs.handles() + [trace.hidden])
            del self.traces[signature]
        for key, workspace in list(self.workspaces.items()):
            workspace.released = True
            self._release(list(workspace.tensors.values()))
            del self.workspaces[key]
        if failures:
            raise CleanupError(f"{len(failures)} traces could not be released: {failures}")
