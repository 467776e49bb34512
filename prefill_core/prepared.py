"""``prepare_prefill``: plan + sampling path + identities, computed once.

The prepared value is the one input of eager invocation, compilation, trace
capture and traced dispatch; none of them re-plans or reclassifies.
"""

from __future__ import annotations

import attrs

from .batch import PrefillBatch
from .layout import PageTableLayout
from .plan import plan_prefill
from .policy import PrefillPolicy
from .request import PrefillRequest
from .sampling import SamplingPath, classify_sampling
from .signatures import PrefillProgramSignature, PrefillTraceSignature, program_signature, trace_signature

__all__ = ["PreparedPrefill", "prepare_prefill", "prepare_request"]


@attrs.frozen
class PreparedPrefill:
    """One planned request with its sampling path and identities."""

    request: PrefillRequest
    sampling_path: SamplingPath
    program_signature: PrefillProgramSignature
    trace_signature: PrefillTraceSignature | None


def prepare_request(request: PrefillRequest, policy: PrefillPolicy) -> PreparedPrefill:
    path = classify_sampling(
        request.sampling, device_top_k_cap=policy.device_top_k_cap, allow_forced_argmax=policy.allow_forced_argmax
    )
    body = trace_signature(request)
    program = program_signature(
        request, path, tile_size=policy.tile_size, static_last_token_tile=policy.static_last_token_tile, body=body
    )
    return PreparedPrefill(request, path, program, body if policy.is_trace_eligible(request.chunk_length) else None)


def prepare_prefill(
    batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout, *, max_position: int | None = None
) -> tuple[PreparedPrefill, ...]:
    """Plans ``batch`` and classifies each request; raises ``PrefillInputError`` on bad input.

    ``max_position`` is the model's maximum position count (Hugging Face's
    ``max_position_embeddings``); when given, a longer row raises
    ``PositionLimitError`` naming it. ``None`` checks lengths against the
    layout's capacity only.
    """
    requests = plan_prefill(batch, policy, layout, max_position=max_position)
    return tuple(prepare_request(request, policy) for request in requests)
