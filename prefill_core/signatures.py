"""Program and trace identities, their stable keys, and staged-input geometry.

* ``PrefillProgramSignature``: every material choice of one eager program:
  variant, padded batch, invocation length, both page-table widths, sampling
  path, log-probs on/off and (only where a program bakes it in) the static
  last-token tile. Active rows, cached offsets, chunk starts, slots and table
  contents are device inputs, never identity.
* ``PrefillTraceSignature``: the sampling-free hidden body a trace captures:
  variant, padded batch, chunk length, table widths. Sampling is excluded,
  so every program alias of one body shares one trace.
* Fingerprints: the capture schema (the persistent inputs a trace of a body
  needs) and the workspace (what one alias's postprocessing needs), so one
  trace family keeps a separate postprocessing workspace per alias.

Builders are pure functions of a planned request.
"""

from __future__ import annotations

import attrs

from .request import PrefillRequest, RequestKind
from .sampling import SamplingPath, distinct_params
from .serialize import digest

__all__ = [
    "PrefillProgramSignature",
    "PrefillTraceSignature",
    "TensorSpec",
    "program_signature",
    "trace_signature",
    "capture_schema",
    "capture_schema_fingerprint",
    "workspace_fingerprint",
    "staged_input_specs",
]


@attrs.frozen
class PrefillTraceSignature:
    """Identity of one captured hidden-body trace."""

    variant: RequestKind
    padded_batch: int
    chunk_length: int
    page_table_width: int
    read_table_width: int

    @property
    def key(self) -> str:
        return "trace-" + digest(self)


@attrs.frozen
class PrefillProgramSignature:
    """Identity of one compiled eager program (body + postprocessing)."""

    variant: RequestKind
    padded_batch: int
    invocation_length: int
    page_table_width: int
    read_table_width: int
    sampling_path: SamplingPath
    logprobs: bool
    last_token_tile: int | None = None

    @property
    def key(self) -> str:
        return "prog-" + digest(self)

    @property
    def body(self) -> PrefillTraceSignature:
        """The sampling-free body this program runs (what a trace would capture)."""
        return PrefillTraceSignature(
            self.variant, self.padded_batch, self.invocation_length, self.page_table_width, self.read_table_width
        )


@attrs.frozen
class TensorSpec:
    """Geometry of one staged device input: name, shape and element type."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def trace_signature(request: PrefillRequest) -> PrefillTraceSignature:
    read_width = 0 if request.read_table is None else request.read_table.width
    return PrefillTraceSignature(
        request.kind, request.padded_batch, request.chunk_length, request.fill_table.width, read_width
    )


def program_signature(
    request: PrefillRequest,
    sampling_path: SamplingPath,
    *,
    tile_size: int,
    static_last_token_tile: bool,
    body: PrefillTraceSignature | None = None,
) -> PrefillProgramSignature:
    """The program identity of ``request`` run with ``sampling_path`` (``body``: its
    ``trace_signature`` when the caller already has it)."""
    body = trace_signature(request) if body is None else body
    # The sampled token's own log-prob is always returned; the flag adds the
    # top-N table, which only device-sampling programs compute.
    logprobs = sampling_path in (SamplingPath.ARGMAX, SamplingPath.TOPK) and any(
        s is not None and s.num_logprobs > 0 for s in distinct_params(request.sampling)
    )
    tile = None
    if static_last_token_tile and request.kind is RequestKind.REGULAR_SINGLE:
        tile = (request.lengths[0] - 1) // tile_size * tile_size
    return PrefillProgramSignature(
        body.variant,
        body.padded_batch,
        body.chunk_length,
        body.page_table_width,
        body.read_table_width,
        sampling_path,
        logprobs,
        tile,
    )


def capture_schema(body: PrefillTraceSignature) -> tuple[TensorSpec, ...]:
    """The persistent inputs a trace of ``body`` reads, refreshed before each replay."""
    b = body.padded_batch
    specs = [
        TensorSpec("tokens", (b, body.chunk_length), "uint32"),
        TensorSpec("start", (b,), "int32"),
        TensorSpec("slots", (b,), "int32"),
        TensorSpec("fill_table", (b, body.page_table_width), "int32"),
    ]
    if body.read_table_width:
        specs.append(TensorSpec("read_table", (b, body.read_table_width), "int32"))
    return tuple(specs)


def capture_schema_fingerprint(body: PrefillTraceSignature) -> str:
    return "schema-" + digest(capture_schema(body))


def _postprocess_specs(signature: PrefillProgramSignature, *, max_logprobs: int) -> tuple[TensorSpec, ...]:
    b = signature.padded_batch
    specs = [TensorSpec("last_token_index", (b,), "int32")]
    if signature.sampling_path is SamplingPath.TOPK:
        specs += [TensorSpec("top_k", (b,), "uint32"), TensorSpec("top_p", (b,), "bfloat16")]
        specs.append(TensorSpec("temperature", (b,), "bfloat16"))
    if signature.logprobs:
        specs.append(TensorSpec("top_logprobs", (b, max_logprobs), "float32"))
    return tuple(specs)


def workspace_fingerprint(signature: PrefillProgramSignature, *, max_logprobs: int) -> str:
    """Identity of the postprocessing workspace one program alias needs."""
    material = (signature.sampling_path, signature.logprobs, _postprocess_specs(signature, max_logprobs=max_logprobs))
    return "workspace-" + digest(material)


def staged_input_specs(signature: PrefillProgramSignature, *, max_logprobs: int) -> tuple[TensorSpec, ...]:
    """Every device input a program with ``signature`` stages, in order."""
    return capture_schema(signature.body) + _postprocess_specs(signature, max_logprobs=max_logprobs)
