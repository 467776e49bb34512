"""Invariant 12: every invalid input raises a named ``PrefillInputError`` subclass.

One example per rule of the rule table lives in test_rules.py; here: sampling
values, policies, layouts, arguments, and the generated properties.

The message names the row (for row rules), the field, the value and the
broken rule; nothing but ``PrefillInputError`` escapes ``prepare_prefill``.
"""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_core import (
    BlockConflictError,
    EmptyBatchError,
    InvalidLayoutError,
    InvalidPolicyError,
    InvalidSamplingError,
    InvalidSlotError,
    PageTableLayout,
    PrefillBatch,
    PrefillError,
    PrefillInputError,
    PrefillPolicy,
    PrefillRow,
    SamplingParams,
    prepare_prefill,
)
from tests.strategies import INVALID_RULES, cases, garbled_specs, invalid_cases

LAYOUT = PageTableLayout(block_size=32, max_num_blocks_per_seq=64, num_blocks=100)
POLICY = PrefillPolicy()
# Row 0 is uncached (writes blocks 0-3); row 1 has one cached block (20) and writes 21, 22.
BASE = (PrefillRow(100, 0, 0, (0, 1, 2, 3)), PrefillRow(96, 32, 1, (20, 21, 22)))


def prepare_rows(*rows: PrefillRow, policy: PrefillPolicy = POLICY, layout: PageTableLayout = LAYOUT):
    return prepare_prefill(PrefillBatch.from_rows(tuple(rows)), policy, layout)


def changed(index: int, **fields) -> tuple[PrefillRow, ...]:
    rows = list(BASE)
    rows[index] = attrs.evolve(rows[index], **fields)
    return tuple(rows)


def check_message(error: PrefillInputError, row: int | None, field: str, value: object) -> None:
    """The message names the row, the field, the value (when given) and a rule."""
    message = str(error)
    assert error.row == row and error.field == field
    if row is not None:
        assert message.startswith(f"row {row}: ")
    assert field in message
    if value is not None:
        assert repr(value) in message
    head, sep, rule = message.partition(" is invalid: ")
    assert sep and len(rule.strip()) >= 8, message


def test_base_rows_are_valid():
    """The hand-built rows the rule examples mutate plan without error."""
    assert len(prepare_rows(*BASE)) == 2


SAMPLING_RULES = [
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -0.5),
    ("temperature", 10**400),
    ("top_k", -1),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("seed", -1),
    ("num_logprobs", 21),
    ("num_logprobs", -1),
]

POLICY_RULES = [
    ("wave not a power of two", "waves", (1, 2, 3)),
    ("waves not increasing", "waves", (4, 2)),
    ("no waves", "waves", ()),
    ("ladder not increasing", "length_ladder", (1024, 128)),
    ("rung not a tile multiple", "length_ladder", (100,)),
    ("max chunk not a tile multiple", "max_chunk_length", 2000),
    ("lane size zero", "lane_size", 0),
    ("flag not a bool", "batching_enabled", 1),
    ("negative max_logprobs", "max_logprobs", -1),
]


@pytest.mark.parametrize(("field", "value"), SAMPLING_RULES, ids=[f"{f}={v!r}"[:24] for f, v in SAMPLING_RULES])
def test_each_sampling_rule_raises_invalid_sampling_error(field, value):
    """A sampling parameter outside its domain raises InvalidSamplingError naming row and field."""
    params = attrs.evolve(SamplingParams(), **{field: value})
    with pytest.raises(InvalidSamplingError) as caught:
        prepare_rows(*changed(1, sampling=params))
    check_message(caught.value, 1, f"sampling.{field}", None if field == "temperature" and value == 10**400 else value)


@pytest.mark.parametrize(("rule", "field", "value"), POLICY_RULES, ids=[r[0] for r in POLICY_RULES])
def test_each_policy_rule_raises_invalid_policy_error(rule, field, value):
    """An inconsistent policy raises InvalidPolicyError naming the field and value."""
    with pytest.raises(InvalidPolicyError) as caught:
        PrefillPolicy(**{field: value})
    check_message(caught.value, None, field, value)


@pytest.mark.parametrize(
    ("field", "value", "layout"),
    [
        ("max_chunk_length", 2080, PageTableLayout(64, 64, 100)),
        ("chunk_quantum", 96, PageTableLayout(64, 64, 100)),
        ("length_ladder", (32, 128), PageTableLayout(64, 64, 100)),
    ],
)
def test_policy_not_aligned_to_the_block_size_is_rejected_at_planning(field, value, layout):
    """A chunk length, quantum or rung that is not a block multiple raises InvalidPolicyError when planning."""
    kwargs = {field: value}
    if field == "max_chunk_length":
        kwargs["chunk_quantum"] = 2048
    policy = PrefillPolicy(**kwargs)
    with pytest.raises(InvalidPolicyError) as caught:
        prepare_prefill(PrefillBatch.from_rows((PrefillRow(10, 0, 0, (0,)),)), policy, layout)
    check_message(caught.value, None, field, value)


@pytest.mark.parametrize(
    ("field", "value"), [("block_size", 48), ("block_size", 0), ("max_num_blocks_per_seq", -1), ("num_blocks", 1.5)]
)
def test_invalid_layout_raises_invalid_layout_error(field, value):
    """A non-power-of-two block size or a non-positive size raises InvalidLayoutError."""
    kwargs = {**dict(block_size=32, max_num_blocks_per_seq=64, num_blocks=100), field: value}
    with pytest.raises(InvalidLayoutError) as caught:
        PageTableLayout(**kwargs)
    check_message(caught.value, None, field, value)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_wrong_argument_types_raise_input_errors(position):
    """Passing something other than a batch, policy or layout raises PrefillInputError naming the argument."""
    args = [PrefillBatch.from_rows(BASE), POLICY, LAYOUT]
    args[position] = None
    with pytest.raises(PrefillInputError) as caught:
        prepare_prefill(*args)
    assert caught.value.field == ("batch", "policy", "layout")[position]


def test_input_errors_are_value_errors_and_prefill_errors():
    """Input errors subclass both PrefillError and ValueError, so existing handlers keep working."""
    for cls in (EmptyBatchError, InvalidSlotError, BlockConflictError, InvalidPolicyError, InvalidSamplingError):
        assert issubclass(cls, PrefillInputError) and issubclass(cls, PrefillError) and issubclass(cls, ValueError)


# ---------------------------------------------------------------- properties


@given(invalid_cases())
def test_generated_invalid_inputs_raise_the_expected_error(case):
    """A batch with one broken rule raises that rule's error naming the row, field and value."""
    with pytest.raises(case.error) as caught:
        case.run()
    check_message(caught.value, case.row, case.field, case.value)


@pytest.mark.parametrize("rule", INVALID_RULES)
@settings(max_examples=max(5, settings.default.max_examples // 6))
@given(data=st.data())
def test_every_generated_rule_is_reported(rule, data):
    """Each breakable rule, generated on its own, raises its error naming the row, field and value."""
    case = data.draw(invalid_cases(rule=rule, min_rows=2, block_sizes=(64,) if "max chunk" in rule else (16, 32, 64)))
    assert case.rule.startswith(rule.split(".")[0])
    with pytest.raises(case.error) as caught:
        case.run()
    check_message(caught.value, case.row, case.field, case.value)


@given(garbled_specs())
def test_only_prefill_input_errors_escape(garbled):
    """Junk in any field either plans (it happened to be valid) or raises PrefillInputError, nothing else."""
    _, spec = garbled
    try:
        if isinstance(spec, tuple):
            prepared = prepare_prefill(*spec)
        else:
            case = spec.build()
            prepared = prepare_prefill(case.batch, case.policy, case.layout)
    except PrefillInputError:
        return
    assert prepared


@given(cases())
def test_valid_inputs_always_plan(case):
    """A generated valid batch prepares into at least one request covering its rows."""
    prepared = prepare_prefill(case.batch, case.policy, case.layout)
    assert sum(p.request.active_batch_size for p in prepared) == len(case.batch.rows)
