"""Caller input forms: tokens, page tables and lengths as lists or integer tensors, hostile forms named.

Every accepted form of a field gives the same results as every other; every
bad form raises a ``PrefillInputError`` naming the field (and the row where
there is one) and leaves the KV pool byte for byte as it was. Tensors without
dense data and invocations that are not an iterable are named too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefill_core.values.errors import PrefillInputError
from prefill_shell.engine.batch_builder import as_token_matrix, build_batch, host_page_table
from tests.helpers import VOCAB, build_runtime, make_tokens, page_table, randomize_pool, token_matrix
from tests.strategies import list_page_tables, token_lists

BS = 16
NUM_BLOCKS = 32
LENGTHS = [40, 20]
CACHED = [16, 0]
SLOTS = [1, 0]
BLOCKS = [[3, 7, 5], [9, 2]]


@pytest.fixture(scope="module")
def rt(tiny_model):
    """One runtime over a seeded-noise pool (so a stray write shows up) shared by this module."""
    runtime = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS)
    randomize_pool(runtime.config.kv, seed=15)
    return runtime


@pytest.fixture(scope="module")
def prompts():
    """The two prompts as int64 rows."""
    return [make_tokens(n, seed=1500 + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def baseline(rt, prompts):
    """Last-token logits of the canonical form: int64 token matrix, int32 page table, int lists."""
    results = rt.prefill(token_matrix(prompts), page_table(BLOCKS), LENGTHS, CACHED, SLOTS)
    return [r.logits for r in results]


def _pool_bytes(rt) -> torch.Tensor:
    return rt.config.kv.snapshot().view(torch.uint8)


def _non_contiguous(matrix: torch.Tensor) -> torch.Tensor:
    """The same values as a strided view (every other column of a wider tensor)."""
    wide = torch.zeros(matrix.shape[0], 2 * matrix.shape[1], dtype=matrix.dtype)
    wide[:, ::2] = matrix
    view = wide[:, ::2]
    assert not view.is_contiguous()
    return view


def _matrix_forms(matrix: torch.Tensor, lists: list[list[int]]) -> dict:
    return {
        "list of lists": lists,
        "tuple of tuples": tuple(map(tuple, lists)),
        "list of int32 tensors": [torch.tensor(r, dtype=torch.int32) for r in lists],
        "int32 tensor": matrix.to(torch.int32),
        "int64 tensor": matrix.to(torch.int64),
        "non-contiguous tensor": _non_contiguous(matrix.to(torch.int64)),
    }


def _vector_forms(values: list[int]) -> dict:
    return {
        "list": list(values),
        "tuple": tuple(values),
        "int32 tensor": torch.tensor(values, dtype=torch.int32),
        "int64 tensor": torch.tensor(values, dtype=torch.int64),
        "non-contiguous tensor": torch.tensor([v for x in values for v in (x, -7)], dtype=torch.int64)[::2],
    }


def _call_args(prompts) -> dict:
    return {
        "tokens": token_matrix(prompts),
        "page_table": page_table(BLOCKS),
        "prompt_lengths": LENGTHS,
        "cached_lengths": CACHED,
        "slots": SLOTS,
    }


def _forms_of(field: str, prompts) -> dict:
    if field == "tokens":
        return _matrix_forms(token_matrix(prompts), [p.tolist() for p in prompts])
    if field == "page_table":
        ragged = [row + [-1] * i for i, row in enumerate(BLOCKS)]  # list rows need not share a width
        return _matrix_forms(page_table(BLOCKS), ragged)
    return _vector_forms(_call_args(prompts)[field])


# ---------------------------------------------------------------- item 1: ragged token lists


def test_a_list_row_shorter_than_its_prompt_length_is_named_and_writes_nothing(rt):
    """The issue's reproducer: row 1 holds 3 tokens for a 50-token prompt; named (row 1, tokens), pool unchanged."""
    before = _pool_bytes(rt)
    table = page_table([[0, 1, 2, 3, 4, 5, 6], [8, 10, 11, 12]])
    with pytest.raises(PrefillInputError) as caught:
        rt.prefill([[5] * 100, [7, 8, 9]], table, [100, 50])
    assert (caught.value.row, caught.value.field) == (1, "tokens")
    assert "3" in str(caught.value) and "50" in str(caught.value)
    assert torch.equal(_pool_bytes(rt), before)


def test_an_empty_list_row_is_named_as_too_short(rt):
    """An empty token row for a 20-token prompt names row 1 and the tokens field, not an internal dtype."""
    before = _pool_bytes(rt)
    with pytest.raises(PrefillInputError) as caught:
        rt.prefill([[5] * 40, []], page_table(BLOCKS), LENGTHS)
    assert (caught.value.row, caught.value.field) == (1, "tokens")
    assert torch.equal(_pool_bytes(rt), before)


@given(data=st.data(), short_row=st.integers(0, 1))
def test_generated_short_list_rows_are_always_named(rt, data, short_row):
    """Whatever a short list row holds, the call names that row's tokens and writes nothing."""
    before = _pool_bytes(rt)
    tokens = data.draw(token_lists(LENGTHS, VOCAB, short_row=short_row))
    with pytest.raises(PrefillInputError) as caught:
        rt.prefill(tokens, page_table(BLOCKS), LENGTHS)
    assert (caught.value.row, caught.value.field) == (short_row, "tokens")
    assert torch.equal(_pool_bytes(rt), before)


@given(data=st.data())
def test_ragged_lists_with_junk_tails_build_the_batch_of_the_tensor_form(rt, data):
    """Longer list rows and list page tables with stale tails give the tensor form's batch and prompt tokens."""
    tokens = data.draw(token_lists(LENGTHS, VOCAB))
    table = data.draw(list_page_tables(BLOCKS))
    matrix = token_matrix([torch.tensor(row[:n]) for row, n in zip(tokens, LENGTHS)])
    layout = rt.config.layout
    want = build_batch(matrix, host_page_table(page_table(BLOCKS), 2), LENGTHS, None, None, None, layout)
    got_tokens = as_token_matrix(tokens)
    got = build_batch(got_tokens, host_page_table(table, 2), LENGTHS, None, None, None, layout)
    assert got == want
    for row, n in enumerate(LENGTHS):
        assert torch.equal(got_tokens[row, :n], matrix[row, :n])


def test_ragged_lists_with_junk_tails_give_the_logits_of_the_tensor_form(rt, prompts):
    """End to end: list rows longer than their prompts and a ragged list page table give the tensor form's logits."""
    tokens = [p.tolist() + [-5, 2**62] for p in prompts]
    table = [BLOCKS[0] + [2**40], BLOCKS[1] + [-7, -7, -7]]
    want = rt.prefill(token_matrix(prompts), page_table(BLOCKS), LENGTHS)
    for got, expected in zip(rt.prefill(tokens, table, LENGTHS), want):
        assert torch.equal(got.logits, expected.logits)


@given(data=st.data(), short_row=st.integers(0, 1))
def test_a_list_page_table_row_shorter_than_its_mapped_prefix_is_named(rt, data, short_row):
    """A list page-table row that stops inside its mapped prefix names that row's page_table; nothing is written."""
    before = _pool_bytes(rt)
    table = data.draw(list_page_tables(BLOCKS, short_row=short_row))
    with pytest.raises(PrefillInputError) as caught:
        rt.prefill([p.tolist() for p in map(make_tokens, LENGTHS, (1, 2))], table, LENGTHS)
    assert (caught.value.row, caught.value.field) == (short_row, "page_table")
    assert torch.equal(_pool_bytes(rt), before)


# ---------------------------------------------------------------- every field accepts the same forms


@pytest.mark.parametrize("field", ["tokens", "page_table", "prompt_lengths", "cached_lengths", "slots"])
def test_every_accepted_form_of_a_field_gives_the_same_logits(rt, prompts, baseline, field):
    """Lists, tuples, int32/int64 and non-contiguous tensors of one field give identical logits."""
    for name, form in _forms_of(field, prompts).items():
        args = _call_args(prompts)
        args[field] = form
        results = rt.prefill(**args)
        for got, want in zip(results, baseline):
            assert torch.equal(got.logits, want), f"{field} as {name}"


# ---------------------------------------------------------------- hostile forms

_TOKENS_OK = [[5] * 40, [6] * 20]
_TABLE_OK = [[3, 7, 5], [9, 2]]

HOSTILE = {
    # tokens
    "tokens bool tensor": ("tokens", torch.ones(2, 40, dtype=torch.bool), None),
    "tokens float tensor": ("tokens", torch.ones(2, 40), None),
    "tokens numpy array": ("tokens", np.ones((2, 40), dtype=np.int64), None),
    "tokens 3-D tensor": ("tokens", torch.ones(2, 40, 1, dtype=torch.int64), None),
    "tokens 1-D tensor": ("tokens", torch.ones(40, dtype=torch.int64), None),
    "tokens flat list": ("tokens", [5] * 40, 0),
    "tokens float row": ("tokens", [[5] * 40, [6.0] * 20], 1),
    "tokens bool row": ("tokens", [[5] * 40, [True] * 20], 1),
    "tokens numpy int row": ("tokens", [[5] * 40, [np.int64(6)] * 20], 1),
    "tokens numpy row": ("tokens", [[5] * 40, np.full(20, 6)], 1),
    "tokens nested row": ("tokens", [[5] * 40, [[6]] * 20], 1),
    "tokens string row": ("tokens", [[5] * 40, "abc"], 1),
    "tokens huge int": ("tokens", [[5] * 40, [6] * 19 + [2**64]], 1),
    "tokens 2-D tensor row": ("tokens", [[5] * 40, torch.ones(1, 20, dtype=torch.int64)], 1),
    "tokens negative": ("tokens", [[5] * 40, [6] * 19 + [-3]], 1),
    "tokens beyond vocab": ("tokens", [[5] * 40, [6] * 19 + [2**40]], 1),
    "tokens none": ("tokens", None, None),
    # page table
    "page_table bool tensor": ("page_table", torch.ones(2, 3, dtype=torch.bool), None),
    "page_table float tensor": ("page_table", torch.ones(2, 3), None),
    "page_table numpy array": ("page_table", np.zeros((2, 3), dtype=np.int32), None),
    "page_table 3-D tensor": ("page_table", torch.zeros(2, 3, 1, dtype=torch.int32), None),
    "page_table float row": ("page_table", [[3, 7, 5], [9.0, 2.0]], 1),
    "page_table bool row": ("page_table", [[3, 7, 5], [True, False]], 1),
    "page_table nested row": ("page_table", [[3, 7, 5], [[9], [2]]], 1),
    "page_table huge int": ("page_table", [[3, 7, 5], [9, 2**64]], 1),
    "page_table huge block id": ("page_table", [[3, 7, 5], [9, 2**40]], 1),
    "page_table negative block": ("page_table", [[3, 7, 5], [9, -2]], 1),
    "page_table empty row": ("page_table", [[3, 7, 5], []], 1),
    "page_table too few rows": ("page_table", [[3, 7, 5]], None),
    "page_table string": ("page_table", "3 7 5", None),
    # lengths
    "prompt_lengths bool list": ("prompt_lengths", [True, 20], 0),
    "prompt_lengths float list": ("prompt_lengths", [40.0, 20], 0),
    "prompt_lengths numpy array": ("prompt_lengths", np.array([40, 20]), None),
    "prompt_lengths numpy ints": ("prompt_lengths", [np.int64(40), 20], 0),
    "prompt_lengths bool tensor": ("prompt_lengths", torch.tensor([True, True]), None),
    "prompt_lengths float tensor": ("prompt_lengths", torch.tensor([40.0, 20.0]), None),
    "prompt_lengths 2-D tensor": ("prompt_lengths", torch.tensor([[40, 20]]), None),
    "prompt_lengths negative": ("prompt_lengths", [40, -20], 1),
    "prompt_lengths zero": ("prompt_lengths", [40, 0], 1),
    "prompt_lengths huge": ("prompt_lengths", [40, 2**70], 1),  # a list row shorter than it: named as tokens
    "prompt_lengths hugely negative": ("prompt_lengths", [40, -(2**70)], 1),
    "prompt_lengths one short": ("prompt_lengths", [40], None),
    "cached_lengths float": ("cached_lengths", [16.0, 0], 0),
    "cached_lengths negative": ("cached_lengths", [-16, 0], 0),
    "cached_lengths past the prompt": ("cached_lengths", [41, 0], 0),
    "cached_lengths huge": ("cached_lengths", [2**70, 0], 0),
    "slots bool": ("slots", [True, False], 0),
    "slots negative": ("slots", [0, -1], 1),
    "slots huge": ("slots", [0, 2**70], 1),
}


NAMES = {
    "tokens": ("tokens",),
    "page_table": ("page_table", "blocks"),
    "prompt_lengths": ("prompt_lengths", "length"),
    "cached_lengths": ("cached_lengths", "cached"),
    "slots": ("slots", "slot"),
}
"""Field names an error may carry for each argument: the shell's argument name or the core's column name."""


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_every_hostile_form_is_named_and_changes_nothing(rt, case):
    """Bools, floats, numpy, nested, huge, negative, empty or wrongly shaped input: a named error, pool unchanged."""
    field, value, row = HOSTILE[case]
    args = {
        "tokens": _TOKENS_OK,
        "page_table": _TABLE_OK,
        "prompt_lengths": LENGTHS,
        "cached_lengths": None,
        "slots": None,
    }
    args[field] = value
    before = _pool_bytes(rt)
    with pytest.raises(PrefillInputError) as caught:
        rt.prefill(**args)
    error = caught.value
    names = NAMES[field] + (NAMES["tokens"] if case == "prompt_lengths huge" else ())
    assert (error.field or "").startswith(names), (case, error.field, error)
    if row is not None:
        assert error.row == row, (case, error)
    assert torch.equal(_pool_bytes(rt), before)


def test_an_empty_token_list_is_the_empty_batch_error_of_an_empty_tensor(rt):
    """``[]`` tokens and a ``[0, T]`` tensor raise the same error class: the batch has no rows."""
    with pytest.raises(PrefillInputError) as from_list:
        rt.prefill([], [], [])
    with pytest.raises(PrefillInputError) as from_tensor:
        rt.prefill(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int32), [])
    assert type(from_list.value) is type(from_tensor.value)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_the_host_token_matrix_is_int64_whatever_the_callers_integer_dtype(dtype):
    """Token tensors of any integer dtype become the int64 matrix that staging and trace buffers hold."""
    matrix = as_token_matrix(torch.ones(2, 5, dtype=dtype))
    assert matrix.dtype is torch.int64 and torch.equal(matrix, torch.ones(2, 5, dtype=torch.int64))


def test_a_caller_list_is_not_mutated(rt):
    """Converting list inputs leaves the caller's lists exactly as they were."""
    tokens, table, lengths = [[5] * 40, [6] * 20], [[3, 7, 5], [9, 2, 4, 4]], [40, 20]
    copies = ([r[:] for r in tokens], [r[:] for r in table], lengths[:])
    rt.prefill(tokens, table, lengths)
    assert (tokens, table, lengths) == copies


# ---------------------------------------------------------------- tensors without dense data, invocations

DENSE_LENGTHS = [64, 50]
DENSE_TABLE = [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.fixture
def runtime(tiny_model):
    """A fresh zeroed pool per test (``rt``'s seeded pool is shared by the module's comparisons)."""
    return build_runtime(tiny_model, num_blocks=48, block_size=16)


def _dense_tokens() -> torch.Tensor:
    return token_matrix([make_tokens(64, seed=1), make_tokens(50, seed=2)])


@pytest.mark.parametrize(
    "field, make",
    [
        ("tokens", lambda t: t.to_sparse()),
        ("tokens", lambda t: t.to("meta")),
        ("page_table", lambda t: torch.tensor(DENSE_TABLE).to("meta")),
        ("prompt_lengths", lambda t: torch.tensor(DENSE_LENGTHS).to("meta")),
    ],
    ids=["sparse tokens", "meta tokens", "meta page_table", "meta prompt_lengths"],
)
def test_a_tensor_without_dense_data_is_named(runtime, field, make):
    """A sparse or meta tensor is a PrefillInputError naming the field (torch's aminmax/copy errors named nothing)."""
    args = dict(tokens=_dense_tokens(), page_table=torch.tensor(DENSE_TABLE), prompt_lengths=DENSE_LENGTHS)
    args[field] = make(args[field] if field == "tokens" else None)
    with pytest.raises(PrefillInputError, match=f"{field}=<tensor .*dense tensor"):
        runtime.prefill(**args)


@pytest.mark.parametrize("entry", ["assemble", "assemble_batch"])
def test_invocations_that_are_not_an_iterable_are_named(runtime, entry):
    """assemble(None, n) or one invocation not in a list is a PrefillInputError naming invocations."""
    (invocation,) = runtime.invocations(runtime.prepare(_dense_tokens()[:1], DENSE_TABLE[:1], DENSE_LENGTHS[:1]))
    for wrong in (None, invocation):
        with pytest.raises(PrefillInputError, match="invocations="):
            getattr(runtime, entry)(wrong, 1)
    assert getattr(runtime, entry)([invocation], 1) is not None  # refused before anything was read
