"""Scoring's careless callers: a bad pair is named at the caller's pair, never at a row of the scorer's own call.

The scorer lays pairs out as its own rows (shared contexts first), so an
error the runtime raised named a row the caller never passed; token ids and
lengths are judged per pair before any call. The score CLI and the lm-eval
model meet empty documents and missing tokenizers with named errors.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest
import torch

from prefill_core import PageTableLayout
from prefill_core.errors import CapacityError, InvalidScoringRequestError, PrefillConfigError
from prefill_shell.backends import TorchBackend
from prefill_shell.cli import model_dtype
from prefill_shell.cli import score as score_cli
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.scoring.scorer import Scorer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = list(range(1, 41))
OTHER = list(range(2, 50))


def _scorer(model, **kwargs) -> Scorer:
    layout = PageTableLayout(16, 16, 64)  # capacity 256 tokens a row
    kv = model.new_kv_cache(layout.num_blocks, layout.block_size)
    return Scorer(PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(), kv, layout=layout)), **kwargs)


def _pool(scorer) -> list[torch.Tensor]:
    return [t.clone() for t in scorer.runtime.config.kv.keys + scorer.runtime.config.kv.values]


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


def test_the_rolling_prefix_token_outside_the_vocabulary_is_named(tiny_model):
    """prefix_token 2**70 raised torch's ValueError and -1 named a row of the scorer's call: now prefix_token."""
    scorer = _scorer(tiny_model, max_length=32)
    for prefix in (2**70, -1, 256):
        with pytest.raises(InvalidScoringRequestError, match="prefix_token=") as caught:
            scorer.score_rolling([OTHER], prefix)
        assert caught.value.field == "prefix_token"


@pytest.mark.parametrize("documents", [None, 5], ids=["None", "int"])
def test_rolling_documents_that_are_not_a_collection_are_named(tiny_model, documents):
    """score_rolling(None) raised "'NoneType' object is not iterable": now a named error, as score(None) is."""
    scorer = _scorer(tiny_model, max_length=32)
    with pytest.raises(InvalidScoringRequestError, match="documents=<") as caught:
        scorer.score_rolling(documents, 1)
    assert caught.value.field == "documents"


def test_numpy_and_tensor_pairs_score_as_their_lists(tiny_model):
    """numpy int arrays (a reversed view too) and int16 tensors give the list pairs' scores exactly."""
    scorer = _scorer(tiny_model)
    want = scorer.score([(CONTEXT, [5, 6]), (OTHER, [7])])
    forms = [
        (np.array(CONTEXT[::-1])[::-1], np.array([5, 6], dtype=np.int32)),
        (torch.tensor(OTHER, dtype=torch.int16), torch.tensor([7], dtype=torch.uint8)),
    ]
    assert scorer.score(forms) == want


class _Tokenizer:
    """Text to ids one character at a time (ids below the tiny model's vocabulary); BOS 1."""

    bos_token_id, eos_token_id = 1, 2

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 200 for c in text]


def _score_args(tmp_path, text: str) -> argparse.Namespace:
    path = tmp_path / "doc.txt"
    path.write_text(text, encoding="utf-8")
    return argparse.Namespace(
        pairs=None,
        document=str(path),
        model="random:tiny",
        device="cpu",
        dtype="float32",
        max_length=32,
        block_size=16,
        max_chunk=64,
    )


@pytest.mark.parametrize("text", ["", "\ufeff"], ids=["empty", "byte-order mark only"])
def test_an_empty_document_scores_zero_not_a_division_by_zero(tiny_model, tmp_path, monkeypatch, capsys, text):
    """score --document on an empty file divided by its 0 tokens (ZeroDivisionError): now 0 tokens, log-likelihood 0."""
    monkeypatch.setattr(model_dtype, "load_model", lambda ref, dtype, device: tiny_model)
    monkeypatch.setattr(score_cli, "load_tokenizer", lambda ref: _Tokenizer())
    score_cli.run_score(_score_args(tmp_path, text))
    out = capsys.readouterr().out
    assert "document: 0 tokens, log-likelihood 0.0000" in out, out


@pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="lm-eval is tested on 3.12")
def test_lm_eval_on_a_model_without_a_tokenizer_names_it():
    """prefill-runtime on random:NAME met lm-eval's text with "'NoneType' object has no attribute 'encode'"."""
    pytest.importorskip("lm_eval")
    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    lm = PrefillRuntimeLM(model="random:tiny", max_length=64)
    with pytest.raises(PrefillConfigError, match="random:tiny.*no tokenizer"):
        lm.tok_encode("hello")
