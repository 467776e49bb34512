"""Pure planning core of the prefill runtime: frozen values and pure functions.

Imports the standard library, attrs and cattrs only: no torch, no ttnn, no
numpy, no I/O, no clocks, no environment, no global mutable state.
"""

from prefill_core.calls.call_plan import CallContext, CallPlan, LaneTraces, PlanKind, plan_call
from prefill_core.calls.manifest import WarmupManifest, manifest_for
from prefill_core.calls.trace_check import can_trace
from prefill_core.inputs.batch import PrefillBatch, PrefillRow
from prefill_core.inputs.rules import RULES, Rule
from prefill_core.kv_groups.attention_layout import AttentionKind, AttentionLayout, KVGroup
from prefill_core.kv_groups.group_packed import GroupedPackedRequest, GroupPackedTables, prepare_grouped_packed
from prefill_core.kv_groups.group_tables import GroupedRequest, GroupStepTables, prepare_grouped
from prefill_core.kv_groups.kv_buffers import KVBuffers
from prefill_core.kv_groups.kv_grouping import vllm_layer_groups
from prefill_core.planning.packed import PackedRequest, PackedStep, plan_packed
from prefill_core.planning.plan import plan_prefill
from prefill_core.planning.prepared import PreparedPrefill, prepare_in_sub_batches, prepare_packed, prepare_prefill
from prefill_core.planning.request import PrefillChunk, PrefillRequest, RequestKind, StepSegment
from prefill_core.planning.shared_spans import SharedRun, SharedWrite, TokenAgreement, shared_runs
from prefill_core.planning.signatures import PrefillProgramSignature, PrefillTraceSignature
from prefill_core.values.errors import *  # noqa: F403 (the hierarchy is public API)
from prefill_core.values.errors import __all__ as _error_names
from prefill_core.values.execution import ExecutionMode, execution_mode, plans_packed, replays
from prefill_core.values.lanes import LaneRoute, route_to_lanes
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy, ceil_div, round_up
from prefill_core.values.sampling import GREEDY_TEMPERATURE, SamplingParams, SamplingPath, is_greedy
from prefill_core.values.serialize import converter, from_json, to_json
from prefill_core.values.tables import SKIP, PageTableView, TableRole, materialize_table

__all__ = [
    "CallContext",
    "CallPlan",
    "ExecutionMode",
    "LaneTraces",
    "PlanKind",
    "plan_call",
    "AttentionKind",
    "AttentionLayout",
    "can_trace",
    "GREEDY_TEMPERATURE",
    "GroupPackedTables",
    "GroupStepTables",
    "GroupedPackedRequest",
    "GroupedRequest",
    "KVBuffers",
    "KVGroup",
    "LaneRoute",
    "PageTableLayout",
    "PackedRequest",
    "PackedStep",
    "SharedRun",
    "SharedWrite",
    "TokenAgreement",
    "PageTableView",
    "PrefillBatch",
    "PrefillChunk",
    "PrefillPolicy",
    "PrefillProgramSignature",
    "PrefillRequest",
    "PrefillRow",
    "PrefillTraceSignature",
    "PreparedPrefill",
    "RULES",
    "RequestKind",
    "Rule",
    "SKIP",
    "SamplingParams",
    "SamplingPath",
    "StepSegment",
    "TableRole",
    "WarmupManifest",
    "ceil_div",
    "execution_mode",
    "converter",
    "from_json",
    "is_greedy",
    "manifest_for",
    "materialize_table",
    "plan_packed",
    "shared_runs",
    "plans_packed",
    "replays",
    "plan_prefill",
    "prepare_grouped",
    "prepare_grouped_packed",
    "prepare_in_sub_batches",
    "prepare_packed",
    "prepare_prefill",
    "round_up",
    "route_to_lanes",
    "to_json",
    "vllm_layer_groups",
    *_error_names,
]
