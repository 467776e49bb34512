"""Program and trace identities, their stable keys, and staged-input geometry.

* ``PrefillProgramSignature``: every material choice of one eager program:
  variant, padded batch, invocation length, both page-table widths, sampling
  path, log-probs on/off, prompt log-probs on/off (the program then also
  runs the LM head over the requested positions of every step) and (only
  where a program bakes it in) the static last-token tile. Active rows, cached offsets, chunk starts, slots and table
  contents are device inputs, never identity.
* ``PrefillTraceSignature``: the sampling-free hidden body a trace captures:
  variant, padded batch, chunk length, table widths. Sampling is excluded,
  so every program alias of one body shares one trace.
The tensors a program stages and produces (names, dtypes, shapes) are the
shell's tensor contract, not identity: they follow from these fields.

Builders are pure functions of a planned request.
"""

from __future__ import annotations

import attrs
from cattrs.gen import make_dict_unstructure_fn, override

from prefill_core.planning.request import PrefillRequest, RequestKind
from prefill_core.values.sampling import SamplingPath, distinct_params
from prefill_core.values.serialize import converter, digest

__all__ = [
    "GroupWidths",
    "PrefillProgramSignature",
    "PrefillTraceSignature",
    "program_signature",
    "trace_signature",
]


@attrs.frozen
class GroupWidths:
    """What a body depends on per KV group of a hybrid model: the group's attention and its table widths.

    The window is material (a windowed kernel call bakes it in) and so are
    the widths (staged shapes); cached offsets and table contents are data.
    """

    kind: str
    window: int | None
    block_size: int
    fill_width: int
    read_width: int


@attrs.frozen
class PrefillTraceSignature:
    """Identity of one captured hidden-body trace (``groups``: one entry per KV group, hybrid models only)."""

    variant: RequestKind
    padded_batch: int
    chunk_length: int
    page_table_width: int
    read_table_width: int
    groups: tuple[GroupWidths, ...] = ()

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
    # Last, and left out of the canonical JSON when False (``serialize``), so
    # every key of a program without prompt log-probs stays what it was.
    prompt_logprobs: bool = False
    groups: tuple[GroupWidths, ...] = ()  # hybrid models only; omitted from the JSON when empty

    @property
    def key(self) -> str:
        return "prog-" + digest(self)

    @property
    def body(self) -> PrefillTraceSignature:
        """The sampling-free body this program runs (what a trace would capture)."""
        return PrefillTraceSignature(
            self.variant,
            self.padded_batch,
            self.invocation_length,
            self.page_table_width,
            self.read_table_width,
            self.groups,
        )


_OMITTED = override(omit_if_default=True)
converter.register_unstructure_hook(
    PrefillProgramSignature,
    make_dict_unstructure_fn(PrefillProgramSignature, converter, prompt_logprobs=_OMITTED, groups=_OMITTED),
)
converter.register_unstructure_hook(
    PrefillTraceSignature, make_dict_unstructure_fn(PrefillTraceSignature, converter, groups=_OMITTED)
)


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
    # The logits path means every row's parameters are None (``classify_sampling``): nothing to scan.
    distinct = () if sampling_path is SamplingPath.LOGITS else distinct_params(request.sampling)
    logprobs = sampling_path in (SamplingPath.ARGMAX, SamplingPath.TOPK) and any(
        s is not None and s.num_logprobs > 0 for s in distinct
    )
    prompt_logprobs = any(s is not None and s.prompt_logprobs is not None for s in distinct)
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
        prompt_logprobs,
        body.groups,
    )
