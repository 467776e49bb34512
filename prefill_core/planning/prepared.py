"""``prepare_prefill``: plan + sampling path + identities, computed once.

The prepared value is the one input of eager invocation, compilation, trace
capture and traced dispatch; none of them re-plans or reclassifies.
"""

from __future__ import annotations

import attrs

from prefill_core.inputs.batch import PrefillBatch
from prefill_core.inputs.validate import check_inputs
from prefill_core.planning.block_order import order_writers_first
from prefill_core.planning.packed import PackedRequest, packed_signature, plan_packed
from prefill_core.planning.plan import plan_prefill
from prefill_core.planning.request import PrefillRequest
from prefill_core.planning.shared_spans import TokenAgreement
from prefill_core.planning.signatures import (
    PrefillProgramSignature,
    PrefillTraceSignature,
    program_signature,
    trace_signature,
)
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy
from prefill_core.values.sampling import SamplingPath, classify_sampling

__all__ = ["PreparedPrefill", "prepare_in_sub_batches", "prepare_packed", "prepare_prefill", "prepare_request"]


@attrs.frozen
class PreparedPrefill:
    """One planned request with its sampling path and identities.

    ``request`` is a padded wave (``PrefillRequest``) or packed steps
    (``PackedRequest``): both implement the request protocol of
    ``request.py``, and the shell reads them only through it. A packed
    request has no trace signature: it runs eagerly only.
    """

    request: PrefillRequest | PackedRequest
    sampling_path: SamplingPath
    program_signature: PrefillProgramSignature
    trace_signature: PrefillTraceSignature | None


def _sampling_path(request: PrefillRequest | PackedRequest, policy: PrefillPolicy) -> SamplingPath:
    return classify_sampling(
        request.sampling, device_top_k_cap=policy.device_top_k_cap, allow_forced_argmax=policy.allow_forced_argmax
    )


def prepare_request(request: PrefillRequest, policy: PrefillPolicy) -> PreparedPrefill:
    path = _sampling_path(request, policy)
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


def prepare_in_sub_batches(
    batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout, *, max_position: int | None = None
) -> tuple[PreparedPrefill, ...]:
    """Plans a batch with more rows than ``lane_size``, whose slots the caller did not choose, in sub-batches.

    A runtime is one lane of ``lane_size`` KV slots; a sub-batch is at most
    ``lane_size`` consecutive rows. The whole call is validated first as one
    batch (as if the lane held a slot per row), so rules across rows of different sub-batches (a block written
    twice, a shared cached block at two columns) hold and errors name caller
    rows. Each sub-batch of consecutive rows is then planned with slots
    ``0..k-1``, and its requests' source rows are mapped back to caller rows,
    so staging, assembly and every later message see caller rows only; the
    requests of every sub-batch are then put in one writer-before-reader
    order (``block_order``).
    """
    check_inputs(batch, attrs.evolve(policy, lane_size=len(batch)), layout, max_position=max_position)
    prepared: list[PreparedPrefill] = []
    for sub_batch in policy.sub_batches(len(batch)):
        picked = slice(sub_batch.start, sub_batch.stop)
        sub = PrefillBatch(
            batch.lengths[picked],
            batch.cached[picked],
            tuple(range(len(sub_batch))),
            batch.blocks[picked],
            batch.sampling[picked],
        )
        for p in prepare_prefill(sub, policy, layout, max_position=max_position):
            rows = tuple(sub_batch.start + r for r in p.request.source_rows)
            prepared.append(attrs.evolve(p, request=attrs.evolve(p.request, source_rows=rows)))
    # A row of a later sub-batch may write a block a row of an earlier one reads: writers first, call-wide.
    by_request = {id(p.request): p for p in prepared}
    ordered = order_writers_first(tuple(p.request for p in prepared), layout.block_size)
    return tuple(by_request[id(request)] for request in ordered)


def prepare_packed(
    batch: PrefillBatch,
    policy: PrefillPolicy,
    layout: PageTableLayout,
    *,
    max_position: int | None = None,
    whole_call_lane: bool = False,
    agreement: TokenAgreement | None = None,
    read_from: dict[int, int] | None = None,
) -> tuple[PreparedPrefill, ...]:
    """``plan_packed`` with each request's sampling path and program identity (no trace: eager only).

    ``whole_call_lane``: the caller chose no slots, so a call wider than a
    lane is still one packed plan (packed steps have no waves to split).
    ``agreement`` and ``read_from``: shared spans (``plan_packed``, rule 6).
    """
    if whole_call_lane and len(batch) > policy.lane_size:
        policy = attrs.evolve(policy, lane_size=len(batch))
    limits = {"max_position": max_position, "agreement": agreement, "read_from": read_from}
    requests = plan_packed(batch, policy, layout, **limits)
    paths = [_sampling_path(request, policy) for request in requests]
    return tuple(PreparedPrefill(r, path, packed_signature(r, path), None) for r, path in zip(requests, paths))
