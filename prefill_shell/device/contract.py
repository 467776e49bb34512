"""The tensor contract: every tensor the runtime stages, runs, keeps or reads, named once.

Each entry is a ``TensorSpec``: its name, the stage of an invocation it
belongs to, its host dtype (``None``: the model's dtype), its shape as
symbolic dimensions, and whether a persistent copy is refreshed in place from
host values (inputs) or written on the device (outputs). Everything else
reads this table: host steps are keyed by spec, backends stage and read back
by spec (the ttnn staging table maps each spec to its device dtype and
layout), warm-up builds its no-write step from it, and workspaces are
allocated from it. Adding a tensor means adding one entry here and the code
that produces it.

Dimensions: ``B`` padded batch, ``S`` step (chunk) length, ``Wf`` / ``Wr``
fill and read table widths, ``H`` hidden size, ``V`` vocabulary, ``N`` the
policy's ``max_logprobs``, ``P`` prompt positions scored by one LM-head call
(at most ``prompt_logprobs.POSITIONS_PER_CALL``).

==================  ==================  ========  =========  =========================================
spec                stage               host      shape      meaning
==================  ==================  ========  =========  =========================================
input_tokens        body input          int64     B, S       prompt token ids; 0 past a prompt's end
                                                             and in padding rows
chunk_start         body input          int64     B          absolute position of the step's first
                                                             token (a tensor: traces must not bake it)
slots               body input          int32     B          KV slot per row; -1 for padding rows
fill_table          body input          int32     B, Wf      blocks this step writes; -1 writes nothing
read_table          body input          int32     B, Wr      chunked steps only: blocks attention reads,
                                                             all >= 0 (filler where unmapped)
last_token_index    postprocess input   int64     B          step-relative row of each last token
top_k               postprocess input   int64     B          device sampling K per row (1: greedy)
top_p               postprocess input   float64   B          device sampling P per row (1: greedy)
temperature         postprocess input   float64   B          device sampling T per row (1: greedy);
                                                             ttnn stages it as the 1/T its sampler reads
packed_*            body input          int64     T / G, .   packed steps only (``PACKED_INPUTS``): tokens,
                                                             positions, write slots, segments, prefix
                                                             tables, and (token, slot) shared writes
                                                             where a step has some; torch backend only
group_*             body input          int32/64  K, ...     hybrid models: each KV group's tables,
                                                             padded (``GROUPED_INPUTS``) or packed
                                                             (``GROUP_PACKED_TABLES``, torch only); ttnn
                                                             stages the padded ones exactly, int32
hidden              body output         model     B, S, H    the body's output after the final norm
last_hidden         output              model     B, H       each row's last-token hidden state
logits              output              float32   B, V       LM head on ``last_hidden``
sampled_tokens      output              int64     B          argmax or sampled token per row
token_logprob       output              float32   B          log-prob of the sampled token
top_ids             output              int64     B, N       best ``N`` token ids per row
top_logprobs        output              float32   B, N       their log-probs
prompt_index        postprocess input   int64     P          prompt log-probs: step row ``b*S + i`` of
                                                             each scored position
prompt_targets      postprocess input   int64     P          the prompt token each position predicts
prompt_hidden       output              model     P, H       those positions' hidden states
prompt_logits       output              float32   P, V       LM head on ``prompt_hidden``
prompt_logprob      output              float32   P          log-prob of each target token
prompt_top_ids      output              int64     P, N       best ``N`` token ids per position
prompt_top_logprobs output              float32   P, N       their log-probs
==================  ==================  ========  =========  =========================================

Every input is refreshed in place before a replay (traced) or uploaded once
per step (eager); the sampling inputs (``SAMPLING_INPUTS``, top-k programs
only) once per invocation, their values from ``sampling_values``. Every
output is produced on the device: a new invocation-owned tensor when eager,
assigned into the program alias's persistent workspace when traced.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs
import torch

from prefill_core import PrefillProgramSignature, PrefillTraceSignature, SamplingParams, SamplingPath

__all__ = [
    "Stage",
    "TensorSpec",
    "INPUT_TOKENS",
    "CHUNK_START",
    "SLOTS",
    "FILL_TABLE",
    "READ_TABLE",
    "LAST_TOKEN_INDEX",
    "TOP_K",
    "TOP_P",
    "TEMPERATURE",
    "HIDDEN",
    "LAST_HIDDEN",
    "LOGITS",
    "SAMPLED_TOKENS",
    "TOKEN_LOGPROB",
    "TOP_IDS",
    "TOP_LOGPROBS",
    "PROMPT_INDEX",
    "PROMPT_TARGETS",
    "PROMPT_HIDDEN",
    "PROMPT_LOGITS",
    "PROMPT_LOGPROB",
    "PROMPT_TOP_IDS",
    "PROMPT_TOP_LOGPROBS",
    "PROMPT_SPECS",
    "PACKED_TOKENS",
    "PACKED_POSITIONS",
    "PACKED_WRITE_SLOTS",
    "PACKED_SEGMENTS",
    "PACKED_PREFIX_TABLE",
    "PACKED_INPUTS",
    "PACKED_SHARED_WRITES",
    "BODY_INPUTS",
    "GROUPED_INPUTS",
    "GROUPED_PACKED_INPUTS",
    "GROUP_PACKED_TABLES",
    "GROUP_PREFIX_FROM",
    "GROUP_PREFIX_TABLES",
    "GROUP_WRITE_SLOTS",
    "GROUP_FILL_TABLES",
    "GROUP_READ_FROM",
    "GROUP_READ_TABLES",
    "GROUP_REUSED",
    "STEP_INPUTS",
    "SAMPLING_INPUTS",
    "ALL_SPECS",
    "body_geometry",
    "program_geometry",
    "output_specs",
    "workspace_specs",
    "sampling_values",
]


class Stage(enum.Enum):
    """Where in one invocation a tensor lives."""

    BODY_INPUT = "body input"
    POSTPROCESS_INPUT = "postprocess input"
    BODY_OUTPUT = "body output"
    OUTPUT = "output"

    @property
    def is_input(self) -> bool:
        return self in (Stage.BODY_INPUT, Stage.POSTPROCESS_INPUT)


# eq=False: specs are module singletons, compared and hashed by identity.
@attrs.frozen(eq=False)
class TensorSpec:
    """One named tensor of the contract."""

    name: str
    stage: Stage
    host_dtype: torch.dtype | None  # None: the model's dtype
    dims: tuple[str, ...]
    meaning: str
    # The backends that stage this tensor (``Backend.name``); None: every backend.
    staged_by: tuple[str, ...] | None = None

    def shape(self, geometry: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(geometry[dim] for dim in self.dims)

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.host_dtype is None else self.host_dtype

    def staged_on(self, backend_name: str) -> bool:
        """Whether a backend named ``backend_name`` stages this tensor."""
        return self.staged_by is None or backend_name in self.staged_by

    def __repr__(self) -> str:
        return f"TensorSpec({self.name})"


_B = ("B",)
INPUT_TOKENS = TensorSpec("input_tokens", Stage.BODY_INPUT, torch.int64, ("B", "S"), "prompt token ids")
CHUNK_START = TensorSpec(
    "chunk_start", Stage.BODY_INPUT, torch.int64, _B, "absolute position of the step's first token"
)
SLOTS = TensorSpec("slots", Stage.BODY_INPUT, torch.int32, _B, "KV slot per row, -1 for padding rows")
FILL_TABLE = TensorSpec("fill_table", Stage.BODY_INPUT, torch.int32, ("B", "Wf"), "blocks the step writes (-1: none)")
READ_TABLE = TensorSpec("read_table", Stage.BODY_INPUT, torch.int32, ("B", "Wr"), "blocks chunked attention reads")
LAST_TOKEN_INDEX = TensorSpec(
    "last_token_index", Stage.POSTPROCESS_INPUT, torch.int64, _B, "step-relative last-token row"
)
TOP_K = TensorSpec("top_k", Stage.POSTPROCESS_INPUT, torch.int64, _B, "device sampling K")
# P and T are float64 on the host and T is not inverted here: float64 holds a
# row's Python floats exactly, and T itself (not 1/T) is what the torch sampler
# divides by, so the torch backend reads back each row's exact parameters and
# samples what host sampling samples. 1/(1/T) is not T for about one double in
# seven (0.9, 0.45 and 0.95 among them), and near T = 1e308 the reciprocal is
# subnormal. The ttnn staging forms 1/T when it stages this tensor.
TOP_P = TensorSpec("top_p", Stage.POSTPROCESS_INPUT, torch.float64, _B, "device sampling P")
TEMPERATURE = TensorSpec("temperature", Stage.POSTPROCESS_INPUT, torch.float64, _B, "device sampling T")
HIDDEN = TensorSpec("hidden", Stage.BODY_OUTPUT, None, ("B", "S", "H"), "body output after the final norm")
LAST_HIDDEN = TensorSpec("last_hidden", Stage.OUTPUT, None, ("B", "H"), "last-token hidden state per row")
LOGITS = TensorSpec("logits", Stage.OUTPUT, torch.float32, ("B", "V"), "LM head output")
SAMPLED_TOKENS = TensorSpec("sampled_tokens", Stage.OUTPUT, torch.int64, _B, "argmax or sampled token per row")
TOKEN_LOGPROB = TensorSpec("token_logprob", Stage.OUTPUT, torch.float32, _B, "log-prob of the sampled token")
TOP_IDS = TensorSpec("top_ids", Stage.OUTPUT, torch.int64, ("B", "N"), "best N token ids")
TOP_LOGPROBS = TensorSpec("top_logprobs", Stage.OUTPUT, torch.float32, ("B", "N"), "log-probs of the best N")
_P = ("P",)
PROMPT_INDEX = TensorSpec("prompt_index", Stage.POSTPROCESS_INPUT, torch.int64, _P, "step row of each scored position")
PROMPT_TARGETS = TensorSpec("prompt_targets", Stage.POSTPROCESS_INPUT, torch.int64, _P, "token each position predicts")
PROMPT_HIDDEN = TensorSpec("prompt_hidden", Stage.OUTPUT, None, ("P", "H"), "hidden state of each scored position")
PROMPT_LOGITS = TensorSpec("prompt_logits", Stage.OUTPUT, torch.float32, ("P", "V"), "LM head on prompt_hidden")
PROMPT_LOGPROB = TensorSpec("prompt_logprob", Stage.OUTPUT, torch.float32, _P, "log-prob of each target token")
PROMPT_TOP_IDS = TensorSpec("prompt_top_ids", Stage.OUTPUT, torch.int64, ("P", "N"), "best N ids per position")
PROMPT_TOP_LOGPROBS = TensorSpec(
    "prompt_top_logprobs", Stage.OUTPUT, torch.float32, ("P", "N"), "log-probs of the best N per position"
)
PROMPT_SPECS = (
    PROMPT_INDEX,
    PROMPT_TARGETS,
    PROMPT_HIDDEN,
    PROMPT_LOGITS,
    PROMPT_LOGPROB,
    PROMPT_TOP_IDS,
    PROMPT_TOP_LOGPROBS,
)
"""What a program with prompt log-probs stages and produces per LM-head call (all transient, eager and traced)."""

# Packed steps only (``prefill_core.planning.packed``): staged by the backends that
# declare ``packed_steps``. ``T``: the step's tokens, ``G``: its segments.
_PACKED_BACKENDS = ("torch",)
PACKED_TOKENS = TensorSpec(
    "packed_tokens", Stage.BODY_INPUT, torch.int64, ("T",), "segment tokens end to end", _PACKED_BACKENDS
)
PACKED_POSITIONS = TensorSpec(
    "packed_positions", Stage.BODY_INPUT, torch.int64, ("T",), "absolute position of each token", _PACKED_BACKENDS
)
PACKED_WRITE_SLOTS = TensorSpec(
    "packed_write_slots",
    Stage.BODY_INPUT,
    torch.int64,
    ("T",),
    "pool slot (block * bs + offset) each token writes, -1 writes nothing",
    _PACKED_BACKENDS,
)
PACKED_SEGMENTS = TensorSpec(
    "packed_segments", Stage.BODY_INPUT, torch.int64, ("G", "3"), "offset, length, start per segment", _PACKED_BACKENDS
)
PACKED_PREFIX_TABLE = TensorSpec(
    "packed_prefix_table",
    Stage.BODY_INPUT,
    torch.int32,
    ("G", "Wp"),
    "blocks of each segment's prefix [0, start), filler 0 past it",
    _PACKED_BACKENDS,
)
PACKED_INPUTS = (PACKED_TOKENS, PACKED_POSITIONS, PACKED_WRITE_SLOTS, PACKED_SEGMENTS, PACKED_PREFIX_TABLE)
"""What a packed step's body reads (eager only: never persistent, never traced)."""
PACKED_SHARED_WRITES = TensorSpec(
    "packed_shared_writes",
    Stage.BODY_INPUT,
    torch.int64,
    ("N", "2"),
    "(token, slot): a step token's K/V also written to that slot (shared spans); only where a step has some",
    _PACKED_BACKENDS,
)
"""Staged beside ``PACKED_INPUTS`` for a step with shared writes, passed as ``forward_packed(..., shared_writes=)``
(``device.model.SHARED_WRITES_CAPABILITY``)."""

_GROUPED_BACKENDS = ("torch", "ttnn")  # padded hybrid steps: ttnn stages them too (tt/staging.py)
_GROUPED_PACKED_BACKENDS = ("torch",)  # packed steps: eager torch only
GROUP_FILL_TABLES = TensorSpec(
    "group_fill_tables",
    Stage.BODY_INPUT,
    torch.int32,
    ("K", "B", "Wgf"),
    "each KV group's fill table, in its block size (-1: none)",
    _GROUPED_BACKENDS,
)
GROUP_READ_TABLES = TensorSpec(
    "group_read_tables",
    Stage.BODY_INPUT,
    torch.int32,
    ("K", "B", "Wgr"),
    "each KV group's read table: the blocks its window reads, filler 0 elsewhere",
    _GROUPED_BACKENDS,
)
GROUP_READ_FROM = TensorSpec(
    "group_read_from", Stage.BODY_INPUT, torch.int32, ("K", "B"), "first column a group may read", _GROUPED_BACKENDS
)
GROUP_REUSED = TensorSpec(
    "group_reused",
    Stage.BODY_INPUT,
    torch.int32,
    ("K", "B", "R"),
    "positions [lo, hi) whose K/V a group takes from the pool",
    _GROUPED_BACKENDS,
)
GROUP_WRITE_SLOTS = TensorSpec(
    "group_write_slots",
    Stage.BODY_INPUT,
    torch.int64,
    ("K", "T"),
    "packed hybrid steps: the slot each token writes in each KV group, -1 writes nothing",
    _GROUPED_PACKED_BACKENDS,
)
GROUP_PREFIX_TABLES = TensorSpec(
    "group_prefix_tables",
    Stage.BODY_INPUT,
    torch.int32,
    ("K", "G", "Wgp"),
    "packed hybrid steps: each segment's prefix blocks per KV group from its first column, filler 0 past them",
    _GROUPED_PACKED_BACKENDS,
)
GROUP_PREFIX_FROM = TensorSpec(
    "group_prefix_from",
    Stage.BODY_INPUT,
    torch.int64,
    ("K", "G", "2"),
    "packed hybrid steps: each segment's first prefix column and column count per KV group",
    _GROUPED_PACKED_BACKENDS,
)
GROUPED_INPUTS = (GROUP_FILL_TABLES, GROUP_READ_TABLES, GROUP_READ_FROM, GROUP_REUSED)
"""What a hybrid model's step reads instead of the fill and read tables (``prefill_core.GroupStepTables``)."""
GROUP_PACKED_TABLES = (GROUP_WRITE_SLOTS, GROUP_PREFIX_TABLES, GROUP_PREFIX_FROM)
"""What a hybrid model's packed step reads instead of the packed write slots and prefix table."""
GROUPED_PACKED_INPUTS = (PACKED_TOKENS, PACKED_POSITIONS, PACKED_SEGMENTS, *GROUP_PACKED_TABLES)
"""What a hybrid model's packed step reads (``prefill_core.GroupPackedTables``): eager only, never traced."""

BODY_INPUTS = (INPUT_TOKENS, CHUNK_START, SLOTS, FILL_TABLE, READ_TABLE, *GROUPED_INPUTS)
"""What the model body reads, in the order a trace's persistent inputs are allocated."""
STEP_INPUTS = (*BODY_INPUTS, LAST_TOKEN_INDEX)
"""Everything one host step holds."""
SAMPLING_INPUTS = (TOP_K, TOP_P, TEMPERATURE)
"""What device top-k sampling reads beside the logits: ``Backend.sample`` takes them as a mapping keyed by spec."""
ALL_SPECS = (
    *STEP_INPUTS,
    *PACKED_INPUTS,
    PACKED_SHARED_WRITES,
    *GROUP_PACKED_TABLES,
    *SAMPLING_INPUTS,
    HIDDEN,
    LAST_HIDDEN,
    LOGITS,
    SAMPLED_TOKENS,
    TOKEN_LOGPROB,
    TOP_IDS,
    TOP_LOGPROBS,
    *PROMPT_SPECS,
)


def body_geometry(body: PrefillTraceSignature, hidden_size: int) -> dict[str, int]:
    """The dimensions of a hidden body's tensors."""
    groups = body.groups
    return {
        "B": body.padded_batch,
        "S": body.chunk_length,
        "Wf": body.page_table_width,
        "Wr": body.read_table_width,
        "H": hidden_size,
        "K": len(groups),  # KV groups (a packed step's "G" counts segments; it has no body geometry)
        "Wgf": max((g.fill_width for g in groups), default=0),
        "Wgr": max((g.read_width for g in groups), default=0),
        "R": 2,
    }


def program_geometry(
    signature: PrefillProgramSignature, hidden_size: int, vocab_size: int, max_logprobs: int
) -> dict[str, int]:
    """The dimensions of every tensor one program (body and postprocessing) touches."""
    return {**body_geometry(signature.body, hidden_size), "V": vocab_size, "N": max_logprobs}


def output_specs(signature: PrefillProgramSignature) -> tuple[TensorSpec, ...]:
    """The outputs a program's postprocessing produces, in production order."""
    path = signature.sampling_path
    if path.returns_logits:
        return (LAST_HIDDEN, LOGITS)
    specs = (LAST_HIDDEN, LOGITS, SAMPLED_TOKENS, TOKEN_LOGPROB)
    return specs + (TOP_IDS, TOP_LOGPROBS) if signature.logprobs else specs


def workspace_specs(signature: PrefillProgramSignature) -> tuple[TensorSpec, ...]:
    """What a traced program alias keeps persistently: its postprocess inputs and its outputs."""
    sampling = SAMPLING_INPUTS if signature.sampling_path is SamplingPath.TOPK else ()
    return (LAST_TOKEN_INDEX, *sampling, *output_specs(signature))


def sampling_values(params: Sequence[SamplingParams]) -> dict[TensorSpec, torch.Tensor]:
    """Each ``SAMPLING_INPUTS`` tensor's host value for a wave's per physical row params, in its host dtype.

    ``params`` has one entry per physical row (padding rows repeat row 0:
    ``postprocess.wave_params``). A greedy row (``SamplingParams.is_greedy``)
    becomes K=1, P=1, T=1: top-1 sampling is the argmax whatever the draw, and
    T=1 keeps the device's 1/T finite. Other rows keep their own values;
    ``top_k == 0`` (no limit) never reaches here: the planner routes it to the
    host path.
    """
    rows = [(1, 1.0, 1.0) if p.is_greedy else (p.top_k, p.top_p, p.temperature) for p in params]
    k, p, t = zip(*rows)
    return {
        TOP_K: torch.tensor(k, dtype=TOP_K.host_dtype),
        TOP_P: torch.tensor(p, dtype=TOP_P.host_dtype),
        TEMPERATURE: torch.tensor(t, dtype=TEMPERATURE.host_dtype),
    }
