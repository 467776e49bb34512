"""``PrefillTraceLifecycle``: capture plans, persistent inputs, replay and ownership.

A trace captures the sampling-free hidden body of one ``PrefillTraceSignature``
over persistent inputs laid out by the core's capture schema. Before every
replay step the step's host values are copied into those inputs in place:
tokens, tables, the chunk start and the slots are data, never baked into
the trace, so one fixed-chunk trace serves every chunk position and every
cached offset. Only the final step's hidden output is finished, into the
persistent workspace of the request's program alias (keyed by the workspace
fingerprint), so serving allocates nothing after capture.

Ownership (``ReplayOwnership``): trace-owned = the persistent inputs and the
hidden output; nested persistent = the alias workspace; newly allocated =
nothing; replay-local = the host step values. The next replay overwrites
all device outputs: results must be read before it (the assembler streams).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from prefill_core import PrefillProgramSignature, PrefillTraceSignature, PreparedPrefill
from prefill_core.errors import CleanupError, TraceCoverageError
from prefill_core.signatures import capture_schema, workspace_fingerprint

from .backends.base import Backend, TraceHandle
from .inputs import BODY_FIELDS, DeviceStep, HostStep, PrefillInputStager
from .ledger import DeviceTensor, Ownership
from .postprocess import PrefillPostprocessor, output_specs, wave_params
from .result import InvocationResult

__all__ = ["CapturedTrace", "ReplayOwnership", "PrefillTraceLifecycle", "warmup_step"]

# The torch body consumes int64 tokens; the ttnn contract (uint32) is the ttnn backend's.
_TORCH_DTYPES = {"uint32": torch.int64, "int32": torch.int32}


@attrs.frozen
class ReplayOwnership:
    """Which values a replay touches, by owner (names of tensors)."""

    trace_owned: tuple[str, ...]
    nested_persistent: tuple[str, ...]
    newly_allocated: tuple[str, ...] = ()
    replay_local: tuple[str, ...] = ("host step values",)


class CapturedTrace:
    """One captured hidden body with its persistent inputs and output."""

    __slots__ = ("signature", "inputs", "hidden", "handle", "replays")

    def __init__(self, signature: PrefillTraceSignature, inputs: DeviceStep, hidden: DeviceTensor, handle: TraceHandle):
        self.signature = signature
        self.inputs = inputs
        self.hidden = hidden
        self.handle = handle
        self.replays = 0


def warmup_step(body: PrefillTraceSignature) -> HostStep:
    """Host values of the body's geometry that write no KV (every fill entry is -1)."""
    b = body.padded_batch
    values = {}
    for spec in capture_schema(body):
        fill = -1 if spec.name in ("fill_table", "slots") else 0
        values[spec.name] = torch.full(spec.shape, fill, dtype=_TORCH_DTYPES.get(spec.dtype, torch.int64))
    values["start"] = values["start"].to(torch.int64)
    return HostStep(None, values["tokens"], values["start"], values["slots"], values["fill_table"],
                    values.get("read_table"), torch.zeros(b, dtype=torch.int64))


class PrefillTraceLifecycle:
    """Captures traces, keeps per-alias workspaces, and replays prepared requests."""

    def __init__(self, backend: Backend, stager: PrefillInputStager, postprocessor: PrefillPostprocessor,
                 body: Callable, model_spec, hidden_dtype: torch.dtype, release: Callable[..., None]):
        self.backend = backend
        self._release = release
        self.stager = stager
        self.postprocessor = postprocessor
        self._body = body
        self._spec = model_spec
        self._hidden_dtype = hidden_dtype
        self.traces: dict[PrefillTraceSignature, CapturedTrace] = {}
        self.workspaces: dict[str, dict[str, DeviceTensor]] = {}

    def fingerprint(self, signature: PrefillProgramSignature) -> str:
        return workspace_fingerprint(signature, max_logprobs=self.postprocessor.max_logprobs)

    def allocate_workspace(self, signature: PrefillProgramSignature) -> None:
        """Persistent postprocessing buffers of one program alias (warm-up only)."""
        key = self.fingerprint(signature)
        if key in self.workspaces:
            return
        specs = output_specs(signature, self._spec.hidden_size, self._spec.vocab_size,
                             self.postprocessor.max_logprobs, self._hidden_dtype)
        workspace: dict[str, DeviceTensor] = {}
        try:
            for name, (shape, dtype) in specs.items():
                workspace[name] = self.backend.upload(torch.zeros(shape, dtype=dtype), f"ws.{name}", Ownership.WORKSPACE)
        except BaseException as primary:
            self._release(list(workspace.values()), primary=primary)
            raise
        self.workspaces[key] = workspace

    def capture(self, body_signature: PrefillTraceSignature) -> CapturedTrace:
        """Allocates the persistent inputs and output of ``body_signature`` and captures it."""
        if body_signature in self.traces:
            return self.traces[body_signature]
        step = warmup_step(body_signature)
        handles: dict[str, DeviceTensor] = {}
        try:
            for name in BODY_FIELDS:
                host = getattr(step, name)
                if host is not None:
                    handles[name] = self.backend.upload(host, f"trace.{name}", Ownership.TRACE)
            b, s = body_signature.padded_batch, body_signature.chunk_length
            hidden_host = torch.zeros(b, s, self._spec.hidden_size, dtype=self._hidden_dtype)
            handles["hidden"] = self.backend.upload(hidden_host, "trace.hidden", Ownership.TRACE)
            inputs, hidden = DeviceStep(handles), handles["hidden"]

            def replay_body() -> None:
                self.backend.assign(hidden, self._body(inputs))

            handle = self.backend.capture(body_signature.key, replay_body)
        except BaseException as primary:
            # A failed capture leaves nothing behind: its buffers go back now.
            self._release(list(handles.values()), primary=primary)
            raise
        trace = CapturedTrace(body_signature, inputs, hidden, handle)
        self.traces[body_signature] = trace
        return trace

    def missing(self, prepared: PreparedPrefill) -> str | None:
        """Why ``prepared`` cannot be replayed, or None when it can."""
        if prepared.trace_signature is None:
            return "its invocation length is not trace-eligible under the policy"
        if prepared.trace_signature not in self.traces:
            return f"no trace was captured for {prepared.trace_signature} ({prepared.trace_signature.key})"
        if self.fingerprint(prepared.program_signature) not in self.workspaces:
            return f"no workspace was allocated for program {prepared.program_signature.key}"
        return None

    def replay(self, prepared: PreparedPrefill, steps: list[HostStep], seeds: tuple[int, ...]) -> InvocationResult:
        """Refreshes and replays every chunk; finishes the last into the alias workspace."""
        reason = self.missing(prepared)
        if reason is not None:
            raise TraceCoverageError(f"cannot replay request {prepared.request.source_rows}: {reason}")
        trace = self.traces[prepared.trace_signature]
        workspace = self.workspaces[self.fingerprint(prepared.program_signature)]
        for step in steps:
            self.stager.refresh(step, trace.inputs)
            self.backend.replay(trace.handle)
            trace.replays += 1
        self.backend.refresh(steps[-1].last_index, workspace["last_index"])
        outputs = self.postprocessor.finish(
            prepared.program_signature, wave_params(prepared), trace.hidden, workspace["last_index"], seeds, [],
            workspace=workspace,
        )
        return InvocationResult(prepared, outputs, [], seeds)

    def ownership(self) -> ReplayOwnership:
        return ReplayOwnership(
            trace_owned=("tokens", "start", "slots", "fill_table", "read_table", "hidden"),
            nested_persistent=("last_index", "last_hidden", "logits", "tokens", "token_logprob", "top_ids", "top_logprobs"),
        )

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
                    self.backend.release_trace(trace.handle)
                except Exception as failure:  # noqa: BLE001 (reported below, retried later)
                    failures.append(f"{signature.key}: {failure!r}")
                    continue
            self._release(trace.inputs.handles() + [trace.hidden])
            del self.traces[signature]
        for key, workspace in list(self.workspaces.items()):
            self._release(list(workspace.values()))
            del self.workspaces[key]
        if failures:
            raise CleanupError(f"{len(failures)} traces could not be released: {failures}")
