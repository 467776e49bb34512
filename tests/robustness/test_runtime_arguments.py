"""``PrefillRuntime`` under a careless caller: tensors without dense data and non-iterable invocations are named."""

from __future__ import annotations

import pytest
import torch

from prefill_core.errors import PrefillInputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = [64, 50]
TABLE = [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.fixture
def runtime(tiny_model, kit):
    return kit.build_runtime(tiny_model, num_blocks=48, block_size=16)


def _tokens(kit) -> torch.Tensor:
    return kit.token_matrix([kit.make_tokens(64, seed=1), kit.make_tokens(50, seed=2)])


@pytest.mark.parametrize(
    "field, make",
    [
        ("tokens", lambda t: t.to_sparse()),
        ("tokens", lambda t: t.to("meta")),
        ("page_table", lambda t: torch.tensor(TABLE).to("meta")),
        ("prompt_lengths", lambda t: torch.tensor(LENGTHS).to("meta")),
    ],
    ids=["sparse tokens", "meta tokens", "meta page_table", "meta prompt_lengths"],
)
def test_a_tensor_without_dense_data_is_named(runtime, kit, field, make):
    """A sparse or meta tensor is a PrefillInputError naming the field (torch's aminmax/copy errors named nothing)."""
    args = dict(tokens=_tokens(kit), page_table=torch.tensor(TABLE), prompt_lengths=LENGTHS)
    args[field] = make(args[field] if field == "tokens" else None)
    with pytest.raises(PrefillInputError, match=f"{field}=<tensor .*dense tensor"):
        runtime.prefill(**args)


@pytest.mark.parametrize("entry", ["assemble", "assemble_batch"])
def test_invocations_that_are_not_an_iterable_are_named(runtime, kit, entry):
    """assemble(None, n) or one invocation not in a list is a PrefillInputError naming invocations."""
    (invocation,) = runtime.invocations(runtime.prepare(_tokens(kit)[:1], TABLE[:1], LENGTHS[:1]))
    for wrong in (None, invocation):
        with pytest.raises(PrefillInputError, match="invocations="):
            getattr(runtime, entry)(wrong, 1)
    assert getattr(runtime, entry)([invocation], 1) is not None  # refused before anything was read
