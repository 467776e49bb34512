"""``Scorer`` under a careless caller: malformed pairs, token ids and settings are named errors; nothing hangs."""

from __future__ import annotations

import signal

import pytest
import torch

from prefill_core import PageTableLayout
from prefill_core.errors import InvalidScoringRequestError, PrefillConfigError
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.scoring.scorer import BlockPool, Scorer, rolling_windows

CONTEXT = list(range(1, 41))


def _runtime(model) -> PrefillRuntime:
    layout = PageTableLayout(16, 16, 64)
    kv = model.new_kv_cache(layout.num_blocks, layout.block_size)
    return PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(), kv, layout=layout))


def _pool(runtime) -> list[torch.Tensor]:
    return [t.clone() for t in runtime.config.kv.keys + runtime.config.kv.values]


@pytest.mark.parametrize(
    "pairs, where",
    [
        ([(CONTEXT, [1.5, 2.0])], "row 0: continuation\\[0\\]=1.5"),
        ([([True, False], [3])], "row 0: context\\[0\\]=True"),
        ([(CONTEXT, [3]), ("hello", "world")], "row 1: context=<str>"),
        ([(torch.tensor(5), [3])], "row 0: context=<tensor"),
        ([(CONTEXT, [3], [4])], "row 0: pair=<tuple>"),
        ([(CONTEXT, [[1, 2]])], "row 0: continuation\\[0\\]=\\[1, 2\\]"),
        (None, "pairs=<NoneType>"),
    ],
    ids=["float ids", "bool ids", "text", "0-d tensor", "triple", "nested", "None"],
)
def test_a_malformed_pair_is_named_at_its_row_and_writes_nothing(tiny_model, pairs, where):
    """Pairs that are not two sequences of int token ids raise InvalidScoringRequestError (floats were truncated)."""
    scorer = Scorer(_runtime(tiny_model))
    before = _pool(scorer.runtime)
    with pytest.raises(InvalidScoringRequestError, match=where):
        scorer.score(pairs)
    assert all(torch.equal(a, b) for a, b in zip(before, _pool(scorer.runtime)))
    assert scorer.pool.available == scorer.pool.size


def test_tensor_and_list_pairs_score_alike(tiny_model):
    """A pair of 1-D integer tensors scores as the same pair of lists."""
    as_lists = Scorer(_runtime(tiny_model)).score([(CONTEXT, [5, 6])])
    assert Scorer(_runtime(tiny_model)).score([(torch.tensor(CONTEXT), torch.tensor([5, 6]))]) == as_lists


@pytest.fixture
def deadline():
    """Fails a test that would hang (an endless loop) after 20 seconds instead of stalling the suite."""

    def expired(*_):
        raise TimeoutError("the call did not return within 20 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("max_length", [0, -1, 2.5, "10"])
def test_a_max_length_that_is_not_a_positive_int_is_refused_not_looped_on(tiny_model, deadline, max_length):
    """max_length 0 or below made score_rolling loop forever; it and non-ints are a PrefillConfigError."""
    with pytest.raises(PrefillConfigError, match="max_length="):
        Scorer(_runtime(tiny_model), max_length=max_length).score_rolling([CONTEXT], 1)
    with pytest.raises(PrefillConfigError, match="max_length="):
        rolling_windows(CONTEXT, 1, max_length)


@pytest.mark.parametrize("max_rows", [0, 2.5])
def test_max_rows_must_be_a_positive_int(tiny_model, max_rows):
    """Scorer(max_rows=0 or 2.5) is a PrefillConfigError."""
    with pytest.raises(PrefillConfigError, match="max_rows="):
        Scorer(_runtime(tiny_model), max_rows=max_rows)


def test_a_rolling_prefix_token_or_document_that_is_not_ids_is_named(tiny_model):
    """score_rolling's prefix_token None and a text document are InvalidScoringRequestErrors naming them."""
    scorer = Scorer(_runtime(tiny_model), max_length=16)
    with pytest.raises(InvalidScoringRequestError, match="prefix_token=None"):
        scorer.score_rolling([CONTEXT], None)
    with pytest.raises(InvalidScoringRequestError, match="row 1: document=<str>"):
        scorer.score_rolling([CONTEXT, "some text"], 1)


@pytest.mark.parametrize("block_ids", [[1.5, 2.5, 3.5], [-1, 2, 3]])
def test_a_block_pool_of_non_block_ids_is_refused(block_ids):
    """BlockPool ids must be ints >= 0: 1.5 was truncated onto block 1, which the caller may hold elsewhere."""
    with pytest.raises(PrefillConfigError, match="block_ids\\[0\\]="):
        BlockPool(block_ids)
