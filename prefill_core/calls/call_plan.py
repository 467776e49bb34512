"""``plan_call``: the one choice of how a call runs, made from values, for every entry point.

Theory of operation
-------------------
A call's plan depends on the caller's rows (``PrefillBatch``), the policy and
layout, the run mode, what the lane can run (packed steps or not), what it
has captured (trace bodies and postprocessing workspaces), and for a model
with KV groups its ``AttentionLayout`` and each group's page-table rows.
``plan_call`` takes all of them in one ``CallContext`` and returns one
``CallPlan``: its kind, its prepared requests (with each group's tables where
the model has groups), which requests cannot replay and why, and whether
the call replays. The runtime, the executor, the serving facades'
``can_trace`` and the warm-up's coverage question all ask it, so they
cannot disagree: ``can_trace`` is "``plan_call`` with ``mode=traced``
raises nothing".

Rules, in the order they decide:

1. **Packed or padded** (``execution.plans_packed``): packed where the lane
   runs packed steps and the call will not replay (an eager call, or an
   ``auto`` call on a lane with nothing captured); a grouped call falls back
   to padded waves when one of its rows reads another's writes
   (``group_packed``). A packed plan without KV groups shares the positions
   where rows begin alike (``planning.shared_spans``) when the context
   carries the rows' ``agreement``.
2. **Lane width**: a caller that chose no slots gets a lane as wide as the
   call. Packed steps have no waves to split, so one plan covers every
   row; padded waves split into sub-batches of ``lane_size`` consecutive
   rows, each with slots ``0..k-1``, validated first as one call (so errors
   name caller rows, and rules across sub-batches hold), then ordered
   writers first call-wide. The same holds with and without KV groups.
3. **Group tables**: each group's row is the caller's row cut to the blocks
   ``ceil(length / group block size)`` covers (``group_rows``).
4. **Replay** (``execution.replays``): a request replays when its body was
   captured and its program alias has a workspace; a ``traced`` call with
   any request uncovered is refused by ``CallPlan.require_replay``
   (``TraceCoverageError`` naming it) before anything runs; an ``auto``
   call replays only when every request is covered.
"""

from __future__ import annotations

import enum

import attrs

from prefill_core.inputs.batch import PrefillBatch
from prefill_core.inputs.validate import check_inputs
from prefill_core.kv_groups.attention_layout import AttentionLayout
from prefill_core.kv_groups.group_packed import GroupedPackedRequest, prepare_grouped_packed
from prefill_core.kv_groups.group_tables import GroupedRequest, group_dependencies, judged_groups, prepare_grouped
from prefill_core.planning.block_order import order_by_dependencies, order_writers_first
from prefill_core.planning.prepared import PreparedPrefill, prepare_packed, prepare_prefill
from prefill_core.planning.shared_spans import TokenAgreement
from prefill_core.planning.signatures import PrefillProgramSignature, PrefillTraceSignature
from prefill_core.values.errors import PrefillInputError, TraceCoverageError, field_error
from prefill_core.values.execution import ExecutionMode, plans_packed, replays
from prefill_core.values.intmath import ceil_div
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy

__all__ = [
    "CallContext",
    "CallPlan",
    "LaneTraces",
    "PlanKind",
    "group_rows",
    "plan_call",
    "trace_gap",
    "workspace_key",
]

Rows = tuple[tuple[int, ...], ...]


class PlanKind(str, enum.Enum):
    """How a call's steps are shaped: padded waves or packed segments, with or without KV groups."""

    PADDED = "padded"
    PACKED = "packed"
    GROUPED = "grouped"
    GROUPED_PACKED = "grouped_packed"


def workspace_key(signature: PrefillProgramSignature) -> tuple:
    """Program aliases with equal keys share one postprocessing workspace (same tensors, same shapes)."""
    return (signature.padded_batch, signature.sampling_path, signature.logprobs)


@attrs.frozen
class LaneTraces:
    """What a lane has captured: trace bodies, and the workspace keys (``workspace_key``) it allocated."""

    bodies: frozenset[PrefillTraceSignature] = attrs.field(default=frozenset(), converter=frozenset)
    workspaces: frozenset[tuple] = attrs.field(default=frozenset(), converter=frozenset)

    def gap(self, prepared: PreparedPrefill) -> str | None:
        """Why ``prepared`` cannot be replayed on this lane, or None when it can (``trace_gap``)."""
        return trace_gap(prepared, self.bodies, self.workspaces)


def trace_gap(prepared: PreparedPrefill, bodies, workspaces) -> str | None:
    """Why ``prepared`` cannot be replayed where ``bodies`` (trace signatures) were captured and ``workspaces``
    (``workspace_key``s) allocated, or None when it can: the one replay rule (any containers that answer ``in``)."""
    if prepared.trace_signature is None:
        return "its invocation length is not trace-eligible under the policy"
    if prepared.trace_signature not in bodies:
        return f"no trace was captured for {prepared.trace_signature} ({prepared.trace_signature.key})"
    if workspace_key(prepared.program_signature) not in workspaces:
        return f"no workspace was allocated for program {prepared.program_signature.key}"
    return None


@attrs.frozen
class CallContext:
    """Everything a call's plan depends on besides the rows: the lane, its captures, the model's groups.

    ``lane_runs_packed``: the policy asks for packed steps and the backend and
    model run them. ``slots_chosen``: the caller named each row's KV slot
    (else rows are numbered and a call wider than the lane is still served,
    rule 2). ``attention`` and ``group_tables`` (each group's caller rows,
    any width) go together for a model with KV groups; ``null_block`` is the
    caller's never-written block; ``groups_share_blocks``: the groups' KV
    buffers are shared (vLLM's plan: one block-id space), else each layer has
    its own and one table may serve every group (``group_rules``).
    ``agreement``: how far the call's rows' tokens agree, where the lane's
    model takes shared writes (``planning.shared_spans``; None: no row shares
    positions); ``read_from``: per row, the first position whose hidden state
    a hook reads (prompt log-probs, MEAN or CLS pooling).
    """

    policy: PrefillPolicy
    layout: PageTableLayout
    mode: ExecutionMode = ExecutionMode.AUTO
    lane_runs_packed: bool = False
    traces: LaneTraces = LaneTraces()
    slots_chosen: bool = True
    attention: AttentionLayout | None = None
    group_tables: tuple[Rows, ...] | None = None
    null_block: int | None = None
    max_position: int | None = None
    groups_share_blocks: bool = True
    agreement: TokenAgreement | None = attrs.field(default=None, eq=False)
    read_from: dict[int, int] | None = attrs.field(default=None, eq=False, hash=False)


@attrs.frozen
class CallPlan:
    """A call as it will run: ``prepared`` in run order, each group's tables in ``grouped`` (grouped kinds).

    ``gaps``: ``(request index, why)`` for every request that cannot
    replay; ``replays``: whether the call runs by replay (every request
    covered, in a mode that replays).
    """

    kind: PlanKind
    mode: ExecutionMode
    prepared: tuple[PreparedPrefill, ...]
    grouped: tuple[GroupedRequest | GroupedPackedRequest, ...]
    gaps: tuple[tuple[int, str], ...]
    replays: bool

    @property
    def packed(self) -> bool:
        return self.kind in (PlanKind.PACKED, PlanKind.GROUPED_PACKED)

    def require_replay(self) -> None:
        """Raises ``TraceCoverageError`` naming the first request a ``traced`` call cannot replay (rule 4)."""
        if self.mode is not ExecutionMode.TRACED or not self.gaps:
            return
        index, why = self.gaps[0]
        first = self.prepared[index]
        msg = (
            f"traced prefill of rows {first.request.source_rows} is not covered: {why}; program "
            f"{first.program_signature.key}; warm up a manifest that holds it or run it eagerly: nothing was run"
        )
        raise TraceCoverageError(msg)


def group_rows(attention: AttentionLayout, group_tables, lengths) -> tuple[Rows, ...]:
    """Each group's rows cut to the blocks a row of ``lengths[r]`` tokens covers in that group's block size."""
    if not isinstance(group_tables, (list, tuple)) or len(group_tables) != len(attention.groups):
        rule = f"one table per KV group ({len(attention.groups)})"
        raise field_error(PrefillInputError, "call", "group_page_tables", type(group_tables).__name__, rule)
    cut = []
    for g, (group, table) in enumerate(zip(attention.groups, group_tables)):
        if len(table) != len(lengths):
            rule = f"one row per caller row ({len(lengths)}), got {len(table)}"
            raise field_error(PrefillInputError, "call", f"group_page_tables[{g}]", len(table), rule)
        cut.append(tuple(tuple(row[: ceil_div(n, group.block_size)]) for row, n in zip(table, lengths)))
    return tuple(cut)


def _lane_wide(policy: PrefillPolicy, rows: int, slots_chosen: bool) -> PrefillPolicy:
    """The policy of a lane as wide as the call, where the caller chose no slots (rule 2)."""
    return policy if slots_chosen or rows <= policy.lane_size else attrs.evolve(policy, lane_size=rows)


def _with_rows(prepared: PreparedPrefill, first: int) -> PreparedPrefill:
    rows = tuple(first + r for r in prepared.request.source_rows)
    return attrs.evolve(prepared, request=attrs.evolve(prepared.request, source_rows=rows))


def _sub_batch(batch: PrefillBatch, picked: range) -> PrefillBatch:
    part = slice(picked.start, picked.stop)
    return PrefillBatch(
        batch.lengths[part], batch.cached[part], tuple(range(len(picked))), batch.blocks[part], batch.sampling[part]
    )


def _padded_sub_batches(batch: PrefillBatch, context: CallContext) -> tuple[PreparedPrefill, ...]:
    """Padded waves of ``lane_size``-row sub-batches, validated as one call, ordered writers first (rule 2)."""
    policy, layout = context.policy, context.layout
    check_inputs(batch, attrs.evolve(policy, lane_size=len(batch)), layout, max_position=context.max_position)
    prepared = [
        _with_rows(p, picked.start)
        for picked in policy.sub_batches(len(batch))
        for p in prepare_prefill(_sub_batch(batch, picked), policy, layout, max_position=context.max_position)
    ]
    by_request = {id(p.request): p for p in prepared}
    ordered = order_writers_first(tuple(p.request for p in prepared), layout.block_size)
    return tuple(by_request[id(request)] for request in ordered)


def _grouped_sub_batches(batch: PrefillBatch, context: CallContext, tables) -> tuple[GroupedRequest, ...]:
    """``prepare_grouped`` per sub-batch of ``lane_size`` rows, judged as one call, ordered call-wide (rule 2)."""
    policy, layout, attention = context.policy, context.layout, context.attention
    wide = attrs.evolve(policy, lane_size=len(batch))
    limits = {"null_block": context.null_block, "max_position": context.max_position}
    _, spans, masked = judged_groups(
        batch, wide, layout, attention, tables, **limits, shared_blocks=context.groups_share_blocks
    )
    planned: list[GroupedRequest] = []
    for picked in policy.sub_batches(len(batch)):
        part = tuple(rows[picked.start : picked.stop] for rows in tables)
        sub = _sub_batch(batch, picked)
        limits = {"null_block": context.null_block, "max_position": context.max_position}
        for grouped in prepare_grouped(
            sub, policy, layout, attention, part, **limits, shared_blocks=context.groups_share_blocks
        ):
            planned.append(attrs.evolve(grouped, prepared=_with_rows(grouped.prepared, picked.start)))
    requests = tuple(g.prepared.request for g in planned)
    order = order_by_dependencies(requests, group_dependencies(requests, attention, masked, spans))
    by_request = {id(g.prepared.request): g for g in planned}
    return tuple(by_request[id(request)] for request in order)


def _shaped(batch: PrefillBatch, context: CallContext) -> tuple[PlanKind, tuple, tuple]:
    """Rules 1-3: the plan's kind, its prepared requests and (grouped kinds) their group tables."""
    policy, layout, limit = context.policy, context.layout, context.max_position
    packed = plans_packed(context.lane_runs_packed, context.mode, bool(context.traces.bodies))
    wide = _lane_wide(policy, len(batch), context.slots_chosen)
    if context.attention is not None:
        if context.group_tables is None:
            raise field_error(
                PrefillInputError, "call", "group_page_tables", None, "the model's KV groups need one table each"
            )
        tables = group_rows(context.attention, context.group_tables, batch.lengths)
        limits = {"null_block": context.null_block, "max_position": limit, "shared_blocks": context.groups_share_blocks}
        if packed:
            found = prepare_grouped_packed(batch, wide, layout, context.attention, tables, **limits)
            if found is not None:
                return PlanKind.GROUPED_PACKED, tuple(g.prepared for g in found), found
        if wide is not policy:
            grouped = _grouped_sub_batches(batch, context, tables)
        else:
            grouped = prepare_grouped(batch, policy, layout, context.attention, tables, **limits)
        return PlanKind.GROUPED, tuple(g.prepared for g in grouped), grouped
    if context.group_tables is not None:
        rule = "the model has no KV groups: pass page_table alone"
        raise field_error(PrefillInputError, "call", "group_page_tables", "given", rule)
    if packed:
        shared = {"agreement": context.agreement, "read_from": context.read_from}
        return PlanKind.PACKED, prepare_packed(batch, wide, layout, max_position=limit, **shared), ()
    if wide is not policy:
        return PlanKind.PADDED, _padded_sub_batches(batch, context), ()
    return PlanKind.PADDED, prepare_prefill(batch, policy, layout, max_position=limit), ()


def plan_call(batch: PrefillBatch, context: CallContext) -> CallPlan:
    """The call's plan (module docstring); raises a ``PrefillInputError`` subclass on bad input, nothing else.

    A ``traced`` plan with gaps is returned as planned (traces may be captured
    before it runs); ``CallPlan.require_replay`` refuses it before anything runs.
    """
    kind, prepared, grouped = _shaped(batch, context)
    gaps = tuple((i, why) for i, p in enumerate(prepared) if (why := context.traces.gap(p)) is not None)
    return CallPlan(kind, context.mode, prepared, grouped, gaps, replays(context.mode, not gaps))
