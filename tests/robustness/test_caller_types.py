"""Careless callers' forms at the runtime and the serving facade: each works as its plain form or is named.

numpy scalars print like the numbers they hold, so an error about one names
its type and the conversion to pass; a serving slot past ``max_batch_size``
(vLLM's ``max_num_seqs``) is refused whatever the policy's ``lane_size``; the
runtime's ``sampling=`` takes None, one SamplingParams for every row, or one
entry per row, and any other form is a named error.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefill_core import PrefillPolicy, SamplingParams
from prefill_core.values.errors import InvalidSamplingError, InvalidSlotError, PrefillInputError
from prefill_shell.backends import TorchBackend
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.plugin_sampling import rows_from_plugin
from tests.helpers import build_runtime, make_tokens, page_table, token_matrix

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POLICY = PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,))  # lane_size 32
MAX_SEQS = 4
LENGTHS = [64, 50]
SAMPLING = dict(temperature=[0.7, 0.9], top_k=[20, 5], top_p=[0.9, 0.8], seed=[5, 6])


@pytest.fixture(scope="module")
def facade(tiny_model):
    """A single-lane facade serving MAX_SEQS rows over a policy whose lane holds 32 slots."""
    facade = ServingFacade(tiny_model, TorchBackend(), max_seq_len=256, max_batch_size=MAX_SEQS, policy=POLICY)
    spec = tiny_model.spec
    facade.allocate_kv_cache((48, spec.num_kv_heads, 16, spec.head_dim), tiny_model.dtype, spec.num_layers)
    return facade


@pytest.fixture(scope="module")
def call():
    tokens = token_matrix([make_tokens(n, seed=40 + n) for n in LENGTHS])
    return SimpleNamespace(tokens=tokens, table=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32))


def _forward(facade, call, **kwargs):
    args = dict(tokens=call.tokens, page_table=call.table, enable_trace=False, prompt_lens=LENGTHS) | kwargs
    return facade.prefill_forward(args.pop("tokens"), args.pop("page_table"), **args)


def _pool(kv) -> list[torch.Tensor]:
    return [t.clone() for t in kv.keys + kv.values]


def _unchanged(before, kv) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, _pool(kv)))


# ---------------------------------------------------------------- slots past max_batch_size


@pytest.mark.parametrize("slot", [MAX_SEQS, 31])
def test_a_slot_at_or_past_max_batch_size_is_refused_at_its_row(facade, call, slot):
    """empty_slots [0, 4] on a facade of max_batch_size 4 (policy lane_size 32): InvalidSlotError at row 1, no KV."""
    before = _pool(facade.kv)
    with pytest.raises(InvalidSlotError, match=f"row 1: slot={slot} is invalid: must be < lane_size={MAX_SEQS}") as e:
        _forward(facade, call, empty_slots=[0, slot])
    assert (e.value.row, e.value.field) == (1, "slot")
    assert _unchanged(before, facade.kv)


def test_the_last_slot_below_max_batch_size_is_served(facade, call):
    """Slots [2, 3] (the top of a 4-slot lane) give the logits of slots [0, 1]."""
    want = _forward(facade, call, empty_slots=[0, 1])
    assert torch.equal(_forward(facade, call, empty_slots=[MAX_SEQS - 2, MAX_SEQS - 1]), want)


# ---------------------------------------------------------------- forms that work as their plain form


FACADE_FORMS = {
    "uint8 tokens": dict(tokens=lambda c: c.tokens.to(torch.uint8)),
    "int16 tokens": dict(tokens=lambda c: c.tokens.to(torch.int16)),
    "transposed-view tokens": dict(tokens=lambda c: c.tokens.t().contiguous().t()),
    "list-of-tuples tokens": dict(tokens=lambda c: [tuple(row) for row in c.tokens.tolist()]),
    "transposed-view page table": dict(page_table=lambda c: c.table.t().contiguous().t()),
    "int16 page table": dict(page_table=lambda c: c.table.to(torch.int16)),
    "int64 page table": dict(page_table=lambda c: c.table.to(torch.int64)),
    "tuple prompt_lens": dict(prompt_lens=lambda c: tuple(LENGTHS)),
    "int32 prompt_lens": dict(prompt_lens=lambda c: torch.tensor(LENGTHS, dtype=torch.int32)),
    "reversed-view prompt_lens": dict(prompt_lens=lambda c: torch.tensor(LENGTHS[::-1]).flip(0)),
    "range empty_slots": dict(empty_slots=lambda c: range(2)),
    "tensor start_pos": dict(start_pos=lambda c: torch.zeros(2, dtype=torch.int32)),
}


@pytest.mark.parametrize("form", sorted(FACADE_FORMS))
def test_an_accepted_form_gives_the_logits_of_the_plain_call(facade, call, form):
    """Integer dtypes, strided views, tuples and ranges give the plain call's logits bit for bit."""
    want = _forward(facade, call)
    given = {name: make(call) for name, make in FACADE_FORMS[form].items()}
    assert torch.equal(_forward(facade, call, **given), want)


SAMPLING_FORMS = {
    "tuples": {name: tuple(values) for name, values in SAMPLING.items()},
    "float32 and int64 tensors": {name: torch.tensor(values) for name, values in SAMPLING.items()},
    "numpy float64 temperatures": dict(temperature=[np.float64(t) for t in SAMPLING["temperature"]]),
    "0-d tensor top_p": dict(top_p=torch.tensor(0.85, dtype=torch.float64)),
    "rows padded past the batch": dict(top_k=SAMPLING["top_k"] + [7, 7]),
}


@pytest.mark.parametrize("form", sorted(SAMPLING_FORMS))
def test_an_accepted_sampling_form_samples_as_its_plain_lists(facade, call, form):
    """Per-row tuples, tensors, numpy float64s (floats) and padded lists give the tokens of the plain lists."""
    fields = SAMPLING | SAMPLING_FORMS[form]
    plain = {name: value.tolist() if isinstance(value, torch.Tensor) else value for name, value in fields.items()}
    plain = {name: [float(v) for v in value] if name == "temperature" else value for name, value in plain.items()}
    want, _ = _forward(facade, call, sampling_params=SimpleNamespace(**plain))
    got, _ = _forward(facade, call, sampling_params=SimpleNamespace(**fields))
    assert torch.equal(got, want)


# ---------------------------------------------------------------- numpy and other scalars: the type is named

CORE_SCALARS = {
    "top_k numpy int64": (dict(top_k=np.int64(20)), "sampling.top_k", "numpy.int64", "int()"),
    "top_k numpy bool": (dict(top_k=np.bool_(True)), "sampling.top_k", "numpy.bool_", "int()"),
    "top_k 0-d tensor": (dict(top_k=torch.tensor(20)), "sampling.top_k", "torch.Tensor", "int()"),
    "temperature numpy float32": (
        dict(temperature=np.float32(0.7)),
        "sampling.temperature",
        "numpy.float32",
        "float()",
    ),
    "temperature str": (dict(temperature="0.7"), "sampling.temperature", "str", "float()"),
    "top_p numpy float32": (dict(top_p=np.float32(0.9)), "sampling.top_p", "numpy.float32", "float()"),
    "seed numpy uint64": (dict(seed=np.uint64(3)), "sampling.seed", "numpy.uint64", "int()"),
    "num_logprobs numpy int32": (dict(num_logprobs=np.int32(2)), "sampling.num_logprobs", "numpy.int32", "int()"),
    "prompt_logprobs numpy int64": (
        dict(prompt_logprobs=np.int64(1)),
        "sampling.prompt_logprobs",
        "numpy.int64",
        "int()",
    ),
}


@pytest.fixture(scope="module")
def runtime(tiny_model):
    return build_runtime(tiny_model, num_blocks=32, block_size=16)


@pytest.mark.parametrize("case", sorted(CORE_SCALARS))
def test_a_sampling_value_of_another_type_names_the_type_and_the_conversion(runtime, case):
    """np.int64(20) printed as 20 beside "must be an int": the error now says numpy.int64 and to pass int()."""
    fields, field, type_name, convert = CORE_SCALARS[case]
    params = SamplingParams(**(dict(temperature=0.8, top_k=40, seed=3) | fields))
    tokens = token_matrix([make_tokens(40, 1), make_tokens(20, 2)])
    before = _pool(runtime.config.kv)
    with pytest.raises(InvalidSamplingError) as caught:
        runtime.prefill(tokens, page_table([[3, 7, 5], [9, 2]]), [40, 20], sampling=[None, params])
    message = str(caught.value)
    assert (caught.value.row, caught.value.field) == (1, field)
    assert f"; got {type_name}, not a Python " in message and f"convert it with {convert}" in message, message
    assert _unchanged(before, runtime.config.kv)


@pytest.mark.parametrize(
    "field, value, type_name",
    [
        ("top_k", [20, np.int64(5)], "numpy.int64"),
        ("num_logprobs", [-2, np.int64(0)], "numpy.int64"),
        ("presence_penalty", [0.0, np.float32(0.5)], "numpy.float32"),
        ("repetition_penalty", [1.0, np.float32(1.0)], "numpy.float32"),
    ],
)
def test_a_plugin_field_holding_a_numpy_scalar_names_its_type_at_its_row(facade, call, field, value, type_name):
    """num_logprobs=np.int64(0) read "0 is invalid: must be -2 or 0": the row's error now names numpy's type."""
    sampling = SimpleNamespace(**(SAMPLING | {field: value}))
    before = _pool(facade.kv)
    with pytest.raises(InvalidSamplingError) as caught:
        _forward(facade, call, sampling_params=sampling)
    assert caught.value.row == 1 and caught.value.field.endswith(field)
    assert f"got {type_name}, not a Python" in str(caught.value), str(caught.value)
    assert _unchanged(before, facade.kv)


@pytest.mark.parametrize(
    "value", [np.array([20, 5]), range(20, 22), {0: 20, 1: 5}], ids=["numpy array", "range", "dict"]
)
def test_a_per_row_field_of_another_container_is_named_as_the_field_not_as_row_0(value):
    """A numpy array of top_k was named "row 0: sampling.top_k=array([20, 5])": now the field and what to pass."""
    sampling = SimpleNamespace(**(SAMPLING | {"top_k": value}))
    with pytest.raises(InvalidSamplingError, match=r"sampling_params\.top_k=<\w+> is invalid: .*list") as caught:
        rows_from_plugin(sampling, 2, 256)
    assert caught.value.row is None and caught.value.field == "sampling_params.top_k"


@pytest.mark.parametrize("value", [2**1100, -(2**1100)], ids=["2**1100", "-2**1100"])
def test_a_repetition_penalty_past_the_float_range_is_named_not_an_overflow(value):
    """repetition_penalty=2**1100 raised OverflowError from math.isfinite: now the row's named error."""
    sampling = SimpleNamespace(**(SAMPLING | {"repetition_penalty": [1.3, value]}))
    with pytest.raises(InvalidSamplingError, match=r"row 1: sampling_params\.repetition_penalty=") as caught:
        rows_from_plugin(sampling, 2, 256)
    assert caught.value.row == 1


# ---------------------------------------------------------------- the runtime's sampling= argument

ROWS, LENGTH = 3, 40
PARAMS = SamplingParams(temperature=0.7, top_k=5, seed=3, num_logprobs=2)


@pytest.fixture(scope="module")
def sampling_runtime(tiny_model):
    runtime = build_runtime(tiny_model, num_blocks=16, block_size=32)
    yield runtime
    runtime.close()


def _sample(runtime, sampling):
    tokens = torch.randint(1, 256, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    table = torch.arange(ROWS * 2, dtype=torch.int32).reshape(ROWS, 2)
    return runtime.prefill(tokens, table, [LENGTH] * ROWS, sampling=sampling)


def test_one_params_applies_to_every_row(sampling_runtime):
    """One SamplingParams gives exactly what the same params repeated per row give."""
    one = _sample(sampling_runtime, PARAMS)
    per_row = _sample(sampling_runtime, [PARAMS] * ROWS)
    assert one == per_row
    assert all(r.token is not None and len(r.top_logprobs) == 2 for r in one)


@pytest.mark.parametrize(
    "sampling",
    [0.7, 1, "greedy", b"x", {"temperature": 1.0}, torch.zeros(ROWS), iter([None] * ROWS), object()],
    ids=["float", "int", "str", "bytes", "dict", "tensor", "iterator", "object"],
)
def test_other_forms_are_named_errors(sampling_runtime, sampling):
    """A number, string, dict, tensor or other non-sequence raises PrefillInputError on field `sampling`."""
    with pytest.raises(PrefillInputError, match="sampling=") as caught:
        _sample(sampling_runtime, sampling)
    assert caught.value.field == "sampling"


def test_wrong_row_count_is_named(sampling_runtime):
    """A per-row list of the wrong length names `sampling` and the row count."""
    with pytest.raises(PrefillInputError, match=r"one entry per row \(3\)") as caught:
        _sample(sampling_runtime, [PARAMS] * 2)
    assert caught.value.field == "sampling"
