"""`sampling=` takes None, one SamplingParams for every row, or one entry per row; any other form is a named error."""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams
from prefill_core.errors import PrefillInputError
from prefill_shell.reference import random_llama
from tests.helpers import build_runtime

ROWS, LENGTH = 3, 40
PARAMS = SamplingParams(temperature=0.7, top_k=5, seed=3, num_logprobs=2)


@pytest.fixture(scope="module")
def runtime():
    model = random_llama(0, "tiny")
    runtime = build_runtime(model, num_blocks=16, block_size=32)
    yield runtime
    runtime.close()


def _call(runtime, sampling):
    tokens = torch.randint(1, 256, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    table = torch.arange(ROWS * 2, dtype=torch.int32).reshape(ROWS, 2)
    return runtime.prefill(tokens, table, [LENGTH] * ROWS, sampling=sampling)


def test_one_params_applies_to_every_row(runtime):
    """One SamplingParams gives exactly what the same params repeated per row give."""
    one = _call(runtime, PARAMS)
    per_row = _call(runtime, [PARAMS] * ROWS)
    assert one == per_row
    assert all(r.token is not None and len(r.top_logprobs) == 2 for r in one)


@pytest.mark.parametrize(
    "sampling",
    [0.7, 1, "greedy", b"x", {"temperature": 1.0}, torch.zeros(ROWS), iter([None] * ROWS), object()],
    ids=["float", "int", "str", "bytes", "dict", "tensor", "iterator", "object"],
)
def test_other_forms_are_named_errors(runtime, sampling):
    """A number, string, dict, tensor or other non-sequence raises PrefillInputError on field `sampling`."""
    with pytest.raises(PrefillInputError, match="sampling=") as caught:
        _call(runtime, sampling)
    assert caught.value.field == "sampling"


def test_wrong_row_count_is_named(runtime):
    """A per-row list of the wrong length names `sampling` and the row count."""
    with pytest.raises(PrefillInputError, match=r"one entry per row \(3\)") as caught:
        _call(runtime, [PARAMS] * 2)
    assert caught.value.field == "sampling"
