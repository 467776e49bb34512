"""The rule table: every rule is triggered, named, and found at the first breaking row.

``RULE_EXAMPLES`` holds one input per rule of ``prefill_core.RULES``; the
first test checks the two lists name the same rules, so a rule added to the
table without an example fails here.
"""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import (
    GREEDY_TEMPERATURE,
    RULES,
    InvalidLengthError,
    InvalidPageTableError,
    InvalidSlotError,
    PageTableLayout,
    PositionLimitError,
    PrefillBatch,
    PrefillInputError,
    PrefillPolicy,
    PrefillRow,
    SamplingParams,
    SamplingPath,
    prepare_prefill,
)
from prefill_core.values.sampling import classify_sampling
from tests.core.values.test_errors import BASE, LAYOUT, POLICY, changed, check_message
from tests.strategies import cases, sampling_params

BIG = PageTableLayout(block_size=32, max_num_blocks_per_seq=4096, num_blocks=10_000)


def plan_rows(rows, *, layout=LAYOUT, max_position=None):
    return prepare_prefill(PrefillBatch.from_rows(tuple(rows)), POLICY, layout, max_position=max_position)


def shared_prefix_rows(second_blocks):
    """Row 0 reads cached blocks (30, 31); row 1 reads ``second_blocks[:2]`` cached and writes the rest."""
    return (PrefillRow(96, 64, 0, (30, 31, 40)), PrefillRow(96, 64, 1, second_blocks))


# rule name -> (call, row, field, value shown by repr or None)
RULE_EXAMPLES = {
    "columns are tuples": (lambda: PrefillBatch([10], (0,), (0,), ((0,),), (None,)), None, "lengths", None),
    "one entry per row": (
        lambda: PrefillBatch((10, 20), (0, 0), (0,), ((0,), (1,)), (None, None)),
        None,
        "slots",
        None,
    ),
    "non-empty": (lambda: PrefillBatch.from_rows(()), None, "rows", ()),
    "length > 0": (lambda: plan_rows(changed(0, length=0)), 0, "length", 0),
    "0 <= cached <= length": (lambda: plan_rows(changed(1, cached=128)), 1, "cached", 128),
    "slot >= 0": (lambda: plan_rows(changed(0, slot=-1)), 0, "slot", -1),
    "unique slots": (lambda: plan_rows(changed(1, slot=0)), 1, "slot", 0),
    "blocks is a tuple": (lambda: plan_rows(changed(0, blocks=[0, 1, 2, 3])), 0, "blocks", None),
    "block ids are ints": (lambda: plan_rows(changed(0, blocks=(0, 1, 2.0, 3))), 0, "blocks[2]", 2.0),
    "sampling type": (lambda: plan_rows(changed(0, sampling={"top_k": 1})), 0, "sampling", {"top_k": 1}),
    "slot < lane_size": (lambda: plan_rows(changed(1, slot=32)), 1, "slot", 32),
    "length <= capacity": (lambda: plan_rows(changed(0, length=2049, blocks=tuple(range(65)))), 0, "length", 2049),
    "length <= max_position": (lambda: plan_rows(BASE, max_position=99), 0, "length", 100),
    "mapped prefix complete": (lambda: plan_rows(changed(0, blocks=(0, 1, 2))), 0, "blocks", None),
    "block ids in the pool": (lambda: plan_rows(changed(1, blocks=(20, 21, 100))), 1, "blocks[2]", 100),
    "no repeated block in a row": (
        lambda: plan_rows(changed(1, length=100, cached=64, blocks=(20, 20, 21, 22))),
        1,
        "blocks[1]",
        20,
    ),
    "one writer per block": (lambda: plan_rows(changed(1, blocks=(20, 21, 3))), 1, "blocks[2]", 3),
    "a block read as cached is written whole at its column": (
        lambda: plan_rows(changed(0, blocks=(0, 1, 20, 3))),
        1,
        "blocks[0]",
        20,
    ),
    "shared cached block at one column": (lambda: plan_rows(shared_prefix_rows((31, 30, 41))), 1, "blocks[0]", 31),
    "temperature": (
        lambda: plan_rows(changed(1, sampling=SamplingParams(temperature=-1e-9))),
        1,
        "sampling.temperature",
        -1e-9,
    ),
    "top_k": (lambda: plan_rows(changed(1, sampling=SamplingParams(top_k=-1))), 1, "sampling.top_k", -1),
    "top_p": (lambda: plan_rows(changed(1, sampling=SamplingParams(top_p=0.0))), 1, "sampling.top_p", 0.0),
    "seed": (lambda: plan_rows(changed(1, sampling=SamplingParams(seed=2**63))), 1, "sampling.seed", 2**63),
    "num_logprobs": (
        lambda: plan_rows(changed(0, sampling=SamplingParams(num_logprobs=21))),
        0,
        "sampling.num_logprobs",
        21,
    ),
    "prompt_logprobs": (
        lambda: plan_rows(changed(1, sampling=SamplingParams(prompt_logprobs=-1))),
        1,
        "sampling.prompt_logprobs",
        -1,
    ),
    "prompt_start": (
        lambda: plan_rows(changed(0, sampling=SamplingParams(prompt_logprobs=0, prompt_start=10**6))),
        0,
        "sampling.prompt_start",
        10**6,
    ),
}


def test_every_rule_in_the_table_has_an_example():
    """RULE_EXAMPLES names exactly the rules of the table, and the table names each rule once."""
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    assert set(RULE_EXAMPLES) == set(names)


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_each_rule_raises_its_error_naming_row_field_value_and_rule(rule):
    """Breaking a rule raises exactly that rule's error class, naming row, field, value and the rule text."""
    call, row, field, value = RULE_EXAMPLES[rule.name]
    with pytest.raises(PrefillInputError) as caught:
        call()
    assert type(caught.value) is rule.error
    check_message(caught.value, row, field, value)
    text = rule.text.format(
        block_size=32, num_blocks=100, capacity=2048, lane_size=32, max_logprobs=20, max_position=99
    )
    assert text in str(caught.value)


def test_shared_cached_prefix_at_the_same_column_is_legal():
    """Two rows reading cached blocks 30 and 31 at the same columns plan, each writing its own block."""
    requests = plan_rows(shared_prefix_rows((30, 31, 41)))
    assert [p.request.fill_table_of(p.request.final_chunk)[0][0] for p in requests] == [40, 41]


def test_slot_error_names_the_lane_count():
    """A slot at or past the lane says how many slots the lane holds."""
    with pytest.raises(InvalidSlotError) as caught:
        plan_rows(changed(1, slot=40))
    assert "lane_size=32" in str(caught.value) and "0..32-1" in str(caught.value)


def test_sub_batches_cover_the_rows_in_ranges_of_lane_size():
    """sub_batches(70) with lane_size 32 is rows 0-31, 32-63, 64-69; zero rows give no group."""
    groups = PrefillPolicy().sub_batches(70)
    assert [(g.start, g.stop) for g in groups] == [(0, 32), (32, 64), (64, 70)]
    assert PrefillPolicy().sub_batches(0) == ()


@pytest.mark.parametrize("limit", [0, -1, 1.5, "4000", True])
def test_max_position_that_is_not_a_positive_int_is_named(limit):
    """max_position must be None or an int > 0; anything else names the argument."""
    with pytest.raises(PrefillInputError) as caught:
        plan_rows(BASE, max_position=limit)
    assert caught.value.field == "max_position"


def test_length_equal_to_max_position_plans():
    """A prompt of exactly max_position tokens plans; one more token raises PositionLimitError."""
    assert plan_rows(BASE, max_position=100)
    with pytest.raises(PositionLimitError):
        plan_rows(changed(0, length=101), max_position=100)


# ---------------------------------------------------------------- which rule and row are named


def test_the_first_rule_in_table_order_is_named_at_its_first_row():
    """Row 1's and row 3's bad lengths beat row 2's duplicate slot: rules run in table order, rows in caller order."""
    rows = [
        PrefillRow(10, 0, 0, (0,)),
        PrefillRow(0, 0, 1, (1,)),
        PrefillRow(10, 0, 0, (2,)),
        PrefillRow(-3, 0, 3, (3,)),
    ]
    with pytest.raises(InvalidLengthError) as caught:
        PrefillBatch.from_rows(rows)
    assert caught.value.row == 1
    rows[1] = PrefillRow(10, 0, 1, (1,))
    with pytest.raises(InvalidLengthError) as caught:
        PrefillBatch.from_rows(rows)
    assert caught.value.row == 3
    rows[3] = PrefillRow(10, 0, 3, (3,))
    with pytest.raises(InvalidSlotError) as caught:
        PrefillBatch.from_rows(rows)
    assert caught.value.row == 2


@pytest.mark.parametrize("order", ["ascending", "shuffled"])
@pytest.mark.parametrize("bad", [-1, 10_000, 2**40])
@pytest.mark.parametrize("where", [1, 500, 1023])
def test_an_out_of_pool_id_in_a_long_table_is_named(order, bad, where):
    """The pool bounds check finds a bad id (negative, past the pool, or 2**40) anywhere in a 1024-block row."""
    blocks = list(range(100, 1124))
    if order == "shuffled":
        random.Random(where).shuffle(blocks)
    blocks[where] = bad
    with pytest.raises(InvalidPageTableError) as caught:
        plan_rows([PrefillRow(1024 * 32, 0, 0, tuple(blocks))], layout=BIG)
    assert caught.value.field == f"blocks[{where}]" and repr(bad) in str(caught.value)


@given(st.data())
def test_shared_sampling_objects_are_checked_for_every_row(data):
    """One bad SamplingParams object shared by later rows is named at its first row."""
    n = data.draw(st.integers(2, 8))
    first_bad = data.draw(st.integers(0, n - 1))
    bad = attrs.evolve(SamplingParams(), top_p=0.0)
    params = [SamplingParams.greedy()] * first_bad + [bad] * (n - first_bad)
    rows = [PrefillRow(64, 0, i, (2 * i, 2 * i + 1), params[i]) for i in range(n)]
    with pytest.raises(PrefillInputError) as caught:
        plan_rows(rows, layout=BIG)
    assert caught.value.row == first_bad and caught.value.field == "sampling.top_p"


@given(cases())
def test_rows_round_trip_through_columns(case):
    """``from_rows`` then ``rows`` gives back the same rows, and ``row(i)`` each one."""
    rows = case.batch.rows
    again = PrefillBatch.from_rows(list(rows))
    assert again == case.batch and again.rows == rows
    assert all(again.row(i) == row for i, row in enumerate(rows))


# ---------------------------------------------------------------- greedy epsilon


@pytest.mark.parametrize("temperature", [0.0, 5e-324, 1e-300, 1e-39, 9.99e-6])
def test_a_temperature_below_the_epsilon_takes_the_argmax_path(temperature):
    """A top-k row whose temperature is below 1e-5 is greedy, so its wave takes the argmax path."""
    params = SamplingParams(temperature=temperature, top_k=20, seed=1)
    assert params.is_greedy
    path = classify_sampling((params,), device_top_k_cap=32, allow_forced_argmax=True)
    assert path is SamplingPath.ARGMAX


@given(sampling_params())
def test_greediness_is_exactly_the_epsilon_or_top_k_one(params):
    """A valid row is greedy iff its temperature is below GREEDY_TEMPERATURE or its top_k is 1."""
    assert params.is_greedy == (params.temperature < GREEDY_TEMPERATURE or params.top_k == 1)
    path = classify_sampling((params,), device_top_k_cap=32, allow_forced_argmax=True)
    assert (path is SamplingPath.ARGMAX) == params.is_greedy
