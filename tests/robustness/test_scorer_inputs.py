"""``Scorer`` under a careless caller: a bad pair, token id, document or setting is a named error; nothing hangs.

The scorer lays pairs out as its own rows (shared contexts first), so an
error the runtime raised would name a row the caller never passed: token ids
and lengths are judged per caller pair before any call, and a refused call
writes no KV and gives every block back. Forms that hold the same ids
(numpy arrays, tensors of any integer dtype) score as their lists. The score
CLI's bad input is tested in tests/cli/test_score.py.
"""

from __future__ import annotations

import re
import signal
import sys

import numpy as np
import pytest
import torch

from prefill_core import PageTableLayout
from prefill_core.values.errors import CapacityError, InvalidScoringRequestError, PrefillConfigError
from prefill_shell.scoring.scorer import BlockPool, Scorer, rolling_windows
from tests.helpers import build_runtime, make_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = list(range(1, 41))
OTHER = list(range(2, 50))


def _scorer(model, **kwargs) -> Scorer:
    return Scorer(build_runtime(model, layout=PageTableLayout(16, 16, 64)), **kwargs)  # capacity 256 tokens a row


def _pool(scorer) -> list[torch.Tensor]:
    return [t.clone() for t in scorer.runtime.config.kv.keys + scorer.runtime.config.kv.values]


# -- pairs -----------------------------------------------------------------------------------------------------


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
    scorer = _scorer(tiny_model)
    before = _pool(scorer)
    with pytest.raises(InvalidScoringRequestError, match=where):
        scorer.score(pairs)
    assert all(torch.equal(a, b) for a, b in zip(before, _pool(scorer)))
    assert scorer.pool.available == scorer.pool.size


@pytest.mark.parametrize(
    "pairs, row, field",
    [
        ([(CONTEXT, [5]), (OTHER, [300])], 1, "continuation[0]"),
        ([(CONTEXT, [5]), (CONTEXT, [6]), (OTHER, [7]), (OTHER, [8, -1])], 3, "continuation[1]"),
        ([(CONTEXT, [5]), ([4, 2**64, 4], [6])], 1, "context[1]"),
        ([(CONTEXT, [2**70])], 0, "continuation[0]"),
        ([(np.array(CONTEXT), np.array([5, 6])), (OTHER, np.array([-3], dtype=np.int8))], 1, "continuation[0]"),
    ],
    ids=["past the vocabulary", "negative, 4th pair", "past int64 in a context", "past int64", "numpy int8"],
)
def test_a_token_id_outside_the_vocabulary_names_the_callers_pair(tiny_model, pairs, row, field):
    """Was "row 5: tokens[48]" (the scorer's own row) or torch's ValueError past int64: now the pair and position."""
    scorer = _scorer(tiny_model)
    before = _pool(scorer)
    with pytest.raises(InvalidScoringRequestError, match=r"must lie in \[0, vocab_size=256\)") as caught:
        scorer.score(pairs)
    assert (caught.value.row, caught.value.field) == (row, field)
    assert all(torch.equal(a, b) for a, b in zip(before, _pool(scorer)))
    assert scorer.pool.available == scorer.pool.size


def test_a_pair_longer_than_a_row_names_the_callers_pair(tiny_model):
    """A 300-token pair (a row holds 256) behind a shared context was named at the scorer's row 2: now pair 2."""
    scorer = _scorer(tiny_model)
    pairs = [(CONTEXT, [5]), (CONTEXT, [6]), ([1 + i % 200 for i in range(299)], [7])]
    with pytest.raises(CapacityError, match=r"row 2: .*300 tokens.*256") as caught:
        scorer.score(pairs)
    assert caught.value.row == 2
    assert scorer.pool.available == scorer.pool.size


def test_an_empty_pair_side_or_a_small_pool_is_named_and_gives_blocks_back(tiny_model):
    """An empty continuation or context names its row; a pool too small raises before anything runs."""
    scorer = _scorer(tiny_model)
    with pytest.raises(InvalidScoringRequestError, match="row 1: continuation"):
        scorer.score([([1, 2], [3]), ([1, 2], [])])
    with pytest.raises(InvalidScoringRequestError, match="row 0: context"):
        scorer.score([([], [3])])
    small = _scorer(tiny_model, pool=BlockPool([5, 6]))
    with pytest.raises(CapacityError, match="row 0: it needs 4 KV blocks"):
        small.score([(make_tokens(60, 1).tolist(), [3])])
    assert small.pool.available == 2


def test_numpy_and_tensor_pairs_score_as_their_lists(tiny_model):
    """int64 tensors, numpy int arrays (a reversed view too) and int16 / uint8 tensors give the list pairs' scores."""
    scorer = _scorer(tiny_model)
    want = scorer.score([(CONTEXT, [5, 6]), (OTHER, [7])])
    forms = [
        [(torch.tensor(CONTEXT), torch.tensor([5, 6])), (torch.tensor(OTHER), torch.tensor([7]))],
        [
            (np.array(CONTEXT[::-1])[::-1], np.array([5, 6], dtype=np.int32)),
            (torch.tensor(OTHER, dtype=torch.int16), torch.tensor([7], dtype=torch.uint8)),
        ],
    ]
    for pairs in forms:
        assert scorer.score(pairs) == want
    assert _scorer(tiny_model).score(forms[0]) == want  # a fresh scorer: no state carried from the list call


# -- rolling documents -------------------------------------------------------------------------------------------


def test_a_rolling_prefix_token_that_is_not_a_vocabulary_id_is_named(tiny_model):
    """prefix_token 2**70 raised torch's ValueError and -1 named a row of the scorer's call: now prefix_token."""
    scorer = _scorer(tiny_model, max_length=32)
    for prefix in (2**70, -1, 256, None):
        with pytest.raises(InvalidScoringRequestError, match=re.escape(f"prefix_token={prefix!r}")) as caught:
            scorer.score_rolling([OTHER], prefix)
        assert caught.value.field == "prefix_token"


@pytest.mark.parametrize("documents", [None, 5], ids=["None", "int"])
def test_rolling_documents_that_are_not_a_collection_are_named(tiny_model, documents):
    """score_rolling(None) raised "'NoneType' object is not iterable": now a named error, as score(None) is."""
    scorer = _scorer(tiny_model, max_length=32)
    with pytest.raises(InvalidScoringRequestError, match="documents=<") as caught:
        scorer.score_rolling(documents, 1)
    assert caught.value.field == "documents"


def test_a_rolling_document_that_is_not_ids_is_named_at_its_row(tiny_model):
    """A text document among token-id documents is an InvalidScoringRequestError naming its row."""
    scorer = _scorer(tiny_model, max_length=16)
    with pytest.raises(InvalidScoringRequestError, match="row 1: document=<str>"):
        scorer.score_rolling([CONTEXT, "some text"], 1)


# -- settings ----------------------------------------------------------------------------------------------------


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
        _scorer(tiny_model, max_length=max_length).score_rolling([CONTEXT], 1)
    with pytest.raises(PrefillConfigError, match="max_length="):
        rolling_windows(CONTEXT, 1, max_length)


@pytest.mark.parametrize("max_rows", [0, 2.5])
def test_max_rows_must_be_a_positive_int(tiny_model, max_rows):
    """Scorer(max_rows=0 or 2.5) is a PrefillConfigError."""
    with pytest.raises(PrefillConfigError, match="max_rows="):
        _scorer(tiny_model, max_rows=max_rows)


@pytest.mark.parametrize("block_ids", [[1.5, 2.5, 3.5], [-1, 2, 3]])
def test_a_block_pool_of_non_block_ids_is_refused(block_ids):
    """BlockPool ids must be ints >= 0: 1.5 was truncated onto block 1, which the caller may hold elsewhere."""
    with pytest.raises(PrefillConfigError, match="block_ids\\[0\\]="):
        BlockPool(block_ids)


@pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="lm-eval is tested on 3.12")
def test_lm_eval_on_a_model_without_a_tokenizer_names_it():
    """prefill-runtime on random:NAME met lm-eval's text with "'NoneType' object has no attribute 'encode'"."""
    pytest.importorskip("lm_eval")
    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    lm = PrefillRuntimeLM(model="random:tiny", max_length=64)
    with pytest.raises(PrefillConfigError, match="random:tiny.*no tokenizer"):
        lm.tok_encode("hello")
