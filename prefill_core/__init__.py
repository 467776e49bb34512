"""Pure planning core of the prefill runtime: frozen values and pure functions.

Imports the standard library, attrs and cattrs only: no torch, no ttnn, no
numpy, no I/O, no clocks, no environment, no global mutable state.
"""

from .attention_layout import AttentionKind, AttentionLayout, KVGroup
from .batch import PrefillBatch, PrefillRow
from .call_plan import CallContext, CallPlan, LaneTraces, PlanKind, plan_call
from .errors import *  # noqa: F403 (the hierarchy is public API)
from .errors import __all__ as _error_names
from .execution import ExecutionMode, execution_mode, plans_packed, replays
from .group_packed import GroupedPackedRequest, GroupPackedTables, prepare_grouped_packed
from .group_tables import GroupedRequest, GroupStepTables, prepare_grouped
from .kv_buffers import KVBuffers
from .kv_grouping import vllm_layer_groups
from .lanes import LaneRoute, route_to_lanes
from .layout import PageTableLayout
from .manifest import WarmupManifest, manifest_for
from .packed import PackedRequest, PackedStep, plan_packed
from .plan import plan_prefill
from .policy import PrefillPolicy, ceil_div, round_up
from .prepared import PreparedPrefill, prepare_in_sub_batches, prepare_packed, prepare_prefill
from .request import PrefillChunk, PrefillRequest, RequestKind, StepSegment
from .rules import RULES, Rule
from .sampling import GREEDY_TEMPERATURE, SamplingParams, SamplingPath, is_greedy
from .serialize import converter, from_json, to_json
from .signatures import PrefillProgramSignature, PrefillTraceSignature
from .tables import SKIP, PageTableView, TableRole, materialize_table
from .trace_check import can_trace

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
