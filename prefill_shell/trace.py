"""``PrefillTraceLifecycle``: capture, persistent inputs, alias workspaces and replay.

A trace captures the sampling-free hidden body of one ``PrefillTraceSignature``
over persistent inputs, one per ``contract.BODY_INPUTS`` entry the body reads.
Before every replay step the step's host values are copied into those inputs
in place: tokens, tables, the chunk start and the slots are data, never baked
into the trace, so one trace serves every request with its chunk length and
table widths, at any chunk position and cached offset. Only the final step's
hidden output is finished, into the persistent workspace of the request's
program alias (``contract.workspace_specs``: for a top-k program also its
K, P and T, which the postprocessor refreshes in place), so serving
allocates nothing after capture.

Ownership: a trace owns its persistent inputs and its hidden output; a
workspace owns its alias's postprocessing tensors; a replay allocates
nothing, so its ``InvocationResult`` owns nothing. The next replay overwrites
every device output: results must be read before it (the assembler streams).

The runtime composes this collaborator; only the runtime calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefill_core import PrefillProgramSignature, PrefillTraceSignature, PreparedPrefill
from prefill_core.errors import CleanupError, TraceCoverageError

from .backends.base import Backend, TraceHandle
from .contract import (
    BODY_INPUTS,
    FILL_TABLE,
    HIDDEN,
    LAST_TOKEN_INDEX,
    READ_TABLE,
    SAMPLING_INPUTS,
    SLOTS,
    STEP_INPUTS,
    body_geometry,
    program_geometry,
    workspace_specs,
)
from .inputs import DeviceStep, HostStep, PrefillInputStager
from .ledger import DeviceTensor, Ownership
from .postprocess import PrefillPostprocessor, wave_params
from .result import InvocationResult

__all__ = ["CapturedTrace", "PrefillTraceLifecycle", "warmup_step"]

# Entries that make a step write nothing: no KV block, no slot.
_NO_WRITE = {FILL_TABLE: -1, SLOTS: -1}
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


def warmup_step(body: PrefillTraceSignature, hidden_size: int) -> HostStep:
    """A step of ``body``'s geometry that writes no KV: zero tokens, every fill entry and slot -1."""
    geometry = body_geometry(body, hidden_size)
    values = {}
    for spec in STEP_INPUTS:
        if spec is READ_TABLE and not body.read_table_width:
            continue
        values[spec] = torch.full(spec.shape(geometry), _NO_WRITE.get(spec, 0), dtype=spec.host_dtype)
    return HostStep(None, values)


def workspace_key(signature: PrefillProgramSignature) -> tuple:
    """Program aliases with equal keys share one workspace (same tensors, same shapes)."""
    return (signature.padded_batch, signature.sampling_path, signature.logprobs)


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
        self.workspaces: dict[tuple, dict] = {}

    def allocate_workspace(self, signature: PrefillProgramSignature) -> None:
        """Persistent postprocessing tensors of one program alias (warm-up only)."""
        key = workspace_key(signature)
        if key in self.workspaces:
            return
        geometry = program_geometry(
            signature, self._spec.hidden_size, self._spec.vocab_size, self._postprocessor.max_logprobs
        )
        workspace: dict = {}
        try:
            for spec in workspace_specs(signature):
                start = torch.full(spec.shape(geometry), _WORKSPACE_START.get(spec, 0), dtype=spec.dtype(self._dtype))
                workspace[spec] = self._backend.upload(start, spec, Ownership.WORKSPACE)
        except BaseException as primary:
            self._release(list(workspace.values()), primary=primary)
            raise
        self.workspaces[key] = workspace

    def capture(self, body_signature: PrefillTraceSignature) -> CapturedTrace:
        """Allocates the persistent inputs and output of ``body_signature`` and captures it."""
        if body_signature in self.traces:
            return self.traces[body_signature]
        step = warmup_step(body_signature, self._spec.hidden_size)
        inputs = DeviceStep()
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

    def gap(self, prepared: PreparedPrefill) -> str | None:
        """Why ``prepared`` cannot be replayed, or None when it can."""
        if prepared.trace_signature is None:
            return "its invocation length is not trace-eligible under the policy"
        if prepared.trace_signature not in self.traces:
            return f"no trace was captured for {prepared.trace_signature} ({prepared.trace_signature.key})"
        if workspace_key(prepared.program_signature) not in self.workspaces:
            return f"no workspace was allocated for program {prepared.program_signature.key}"
        return None

    def replay(
        self,
        prepared: PreparedPrefill,
        steps: list[HostStep],
        seeds: tuple[int, ...],
        on_hidden: Callable[[object, int], None] | None = None,
    ) -> InvocationResult:
        """Refreshes and replays every chunk; finishes the last into the alias workspace.

        ``on_hidden(hidden, i)`` (prompt log-probs) sees each replayed step's hidden output before the
        next replay overwrites it; what it allocates is its own and released by it.
        """
        reason = self.gap(prepared)
        if reason is not None:
            raise TraceCoverageError(f"cannot replay request {prepared.request.source_rows}: {reason}")
        trace = self.traces[prepared.trace_signature]
        workspace = self.workspaces[workspace_key(prepared.program_signature)]
        for index, step in enumerate(steps):
            self._stager.refresh(step, trace.inputs)
            self._backend.replay(trace.handle)
            trace.replays += 1
            if on_hidden is not None:
                on_hidden(trace.hidden.value, index)
        self._backend.refresh(steps[-1][LAST_TOKEN_INDEX], workspace[LAST_TOKEN_INDEX])
        outputs = self._postprocessor.finish(
            prepared.program_signature,
            wave_params(prepared),
            trace.hidden,
            workspace[LAST_TOKEN_INDEX],
            seeds,
            [],
            workspace=workspace,
        )
        return InvocationResult(prepared, outputs, [], seeds)

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
            self._release(list(workspace.values()))
            del self.workspaces[key]
        if failures:
            raise CleanupError(f"{len(failures)} traces could not be released: {failures}")
