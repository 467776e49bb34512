"""Embeddings, classification and reranking through the runtime against what we did not write.

Per family (Llama, Qwen2, Qwen3, Mistral), on random checkpoints written by
sentence-transformers 6.3 and transformers 5 themselves (``pooling_kit``),
float32, with rows past one 64-token chunk and rows that share a cached
prefix:

* ``SentenceTransformer.encode``: LAST (with its Normalize module) and MEAN
  (without), normalised and not, ``truncate_dim`` (the runtime truncates,
  then normalises: vLLM's order, equal to ``encode(truncate_dim=d,
  normalize_embeddings=True)``);
* ``CrossEncoder.predict`` and ``CrossEncoder.rank`` on a one-label
  ``*ForSequenceClassification``: one query against many documents, the
  query's blocks computed once;
* transformers' ``*ForSequenceClassification`` logits with three labels,
  raw and through vLLM's softmax;
* the Qwen3-Reranker recipe: transformers' ``*ForCausalLM`` last-token
  logits, ``softmax([no, yes])[1]``.

Qwen2's folders are tokenized by the tokenizer they were saved with on both
sides (``pooling_kit.OWN_TOKENIZER_CLASS``: transformers 5's ``AutoTokenizer``
would replace it). Every vector within 1e-5 relative (``max|ours - theirs| / max|theirs|``),
eager (packed steps) and traced (after a warm-up: replayed padded waves).
In bfloat16, our embeddings' drift from float32 sentence-transformers is at
most twice sentence-transformers' own bfloat16 drift.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_core.values.pooling import PoolingType
from prefill_shell.pooling import PoolingRunner
from prefill_shell.pooling.runner import qwen3_reranker_prompt
from tests.e2e.pooling_kit import (
    ALL_FAMILIES,
    causal_folder,
    cross_encoder,
    sentence_transformer,
    seq_cls_folder,
    st_folder,
    texts,
    tokenizer_option,
)
from tests.family_kit import relative_error

pytest.importorskip("sentence_transformers")

RTOL = 1e-5
LENGTHS = [1, 7, 40, 100, 170]  # 100 and 170 words run past one 64-token chunk
OPTIONS = dict(block_size=16, max_chunk=64, pool_tokens=4096)


def _texts(seed: int) -> list[str]:
    # Three rows sharing 96 words (six whole blocks), then rows of their own lengths.
    return texts(seed, LENGTHS) + texts(seed + 1, [96, 120, 150], shared=96)


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    for a, b in zip(ours, theirs):
        assert relative_error(a, b) <= RTOL, (relative_error(a, b), a[:4], b[:4])


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def family(request):
    return request.param


@pytest.mark.parametrize(("mode", "normalize"), [("lasttoken", True), ("mean", False)])
def test_embeddings_equal_sentence_transformers_encode(family, mode, normalize, tmp_path):
    folder = st_folder(family, tmp_path / "st", mode, normalize)
    st = sentence_transformer(family, folder)
    runner = PoolingRunner.from_folder(folder, **OPTIONS, **tokenizer_option(family, folder))
    assert runner.pooler.pooling_type is (PoolingType.LAST if mode == "lasttoken" else PoolingType.MEAN)
    assert runner.pooler.normalize is normalize
    rows = _texts(7)
    # The folder's own settings: Normalize module or not.
    _close(runner.embed(rows), st.encode(rows, convert_to_tensor=True))
    # Normalised on request.
    _close(runner.embed(rows, normalize=True), st.encode(rows, convert_to_tensor=True, normalize_embeddings=True))
    # Matryoshka: truncate, then normalise.
    theirs = st.encode(rows, convert_to_tensor=True, truncate_dim=24, normalize_embeddings=True)
    _close(runner.embed(rows, dimensions=24, normalize=True), theirs)
    if not normalize:  # truncated and left as it is
        _close(runner.embed(rows, dimensions=24), st.encode(rows, convert_to_tensor=True, truncate_dim=24))
    # Prefix sharing serves LAST pooling only: MEAN rows compute every position.
    before = runner.computed_tokens
    runner.embed(rows)
    tokens = sum(len(r.split()) for r in rows)
    computed = runner.computed_tokens - before
    assert computed < tokens if mode == "lasttoken" else computed == tokens


def test_cross_encoder_scores_and_ranks_equal_sentence_transformers(family, tmp_path):
    folder = seq_cls_folder(family, tmp_path / "ce", num_labels=1)
    ce = cross_encoder(family, folder)
    runner = PoolingRunner.from_folder(folder, **OPTIONS, **tokenizer_option(family, folder))
    query, *documents = texts(11, [70, 1, 9, 33, 64, 90, 15, 120])
    pairs = [(query, d) for d in documents]
    theirs = ce.predict(pairs, convert_to_tensor=True)
    before = runner.computed_tokens
    _close(runner.score(query, documents)[None], theirs[None])
    # The 70-word query's four whole blocks are computed once (the runner's prefix call), and so is the rest of
    # it (shared spans: the first document's row computes it, the others take its K/V), not once per document.
    assert runner.computed_tokens - before == 64 + (70 - 64) + sum(len(d.split()) for d in documents)
    raw = ce.predict(pairs, convert_to_tensor=True, activation_fn=torch.nn.Identity())
    _close(runner.score(query, documents, use_activation=False)[None], raw[None])
    ranked = ce.rank(query, documents)
    ours = runner.rerank(query, documents)
    assert [i for i, _ in ours] == [r["corpus_id"] for r in ranked]
    _close(torch.tensor([s for _, s in ours])[None], torch.tensor([float(r["score"]) for r in ranked])[None])


def test_three_label_classification_equals_transformers(family, tmp_path):
    import transformers

    folder = seq_cls_folder(family, tmp_path / "cls", num_labels=3)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    runner = PoolingRunner.from_folder(folder, **OPTIONS, **tokenizer_option(family, folder))
    rows = _texts(3)
    with torch.no_grad():
        logits = torch.cat([hf(**runner.tokenizer(r, return_tensors="pt")).logits for r in rows])
    _close(runner.classify(rows, use_activation=False), logits)
    _close(runner.classify(rows), logits.softmax(-1))  # vLLM: softmax for two or more labels


def test_the_yes_no_reranker_recipe_equals_transformers(family, tmp_path):
    import transformers

    folder = causal_folder(family, tmp_path / "lm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    runner = PoolingRunner.from_folder(folder, **OPTIONS, **tokenizer_option(family, folder))
    query, *documents = texts(5, [40, 3, 30, 80, 12])
    tokenizer = runner.tokenizer
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    expected = []
    with torch.no_grad():
        for document in documents:
            ids = tokenizer(qwen3_reranker_prompt(query, document), return_tensors="pt")["input_ids"]
            last = hf(input_ids=ids).logits[0, -1]
            expected.append(torch.stack((last[no], last[yes])).softmax(-1)[1])
    ranked = runner.rerank(query, documents)
    scores = torch.zeros(len(documents))
    for index, score in ranked:
        scores[index] = score
    _close(scores[None], torch.stack(expected)[None])
    assert [i for i, _ in ranked] == sorted(range(len(documents)), key=lambda i: -float(expected[i]))


TRACED = dict(
    block_size=16,
    pool_tokens=2048,
    max_length=256,
    policy=PrefillPolicy(max_chunk_length=64, chunk_quantum=64, length_ladder=(64,), waves=(1, 2), lane_size=4),
)


def test_traced_embeddings_and_scores_equal_sentence_transformers(family, tmp_path):
    """After a warm-up, embed (MEAN) and score replay captured traces and still equal sentence-transformers."""
    folder = st_folder(family, tmp_path / "st", "mean", normalize=True)
    runner = PoolingRunner.from_folder(folder, **TRACED, **tokenizer_option(family, folder))
    runner.warm_up()
    rows = _texts(9)
    _close(
        runner.embed(rows, mode="traced"),
        sentence_transformer(family, folder).encode(rows, convert_to_tensor=True),
    )
    assert sum(trace.replays for trace in runner.runtime.captured_traces()) > 0
    folder = seq_cls_folder(family, tmp_path / "ce", num_labels=1)
    runner = PoolingRunner.from_folder(folder, **TRACED, **tokenizer_option(family, folder))
    runner.warm_up()
    query, *documents = texts(12, [70, 1, 9, 64, 120])
    theirs = cross_encoder(family, folder).predict([(query, d) for d in documents], convert_to_tensor=True)
    _close(runner.score(query, documents, mode="traced")[None], theirs[None])


def test_bfloat16_embeddings_drift_from_float32_no_more_than_sentence_transformers_own(family, tmp_path):
    """In bfloat16 both sides drift from float32 sentence-transformers; ours by no more than 2x its own drift."""
    folder = st_folder(family, tmp_path / "st", "lasttoken", normalize=True)
    rows = _texts(13)
    reference = sentence_transformer(family, folder).encode(rows, convert_to_tensor=True)
    theirs = sentence_transformer(family, folder).to(torch.bfloat16).encode(rows, convert_to_tensor=True)
    ours = PoolingRunner.from_folder(folder, dtype="bfloat16", **OPTIONS, **tokenizer_option(family, folder))
    ours = ours.embed(rows)
    their_drift = max(relative_error(b, a) for a, b in zip(reference, theirs))
    our_drift = max(relative_error(b, a) for a, b in zip(reference, ours))
    assert our_drift <= 2 * their_drift + 1e-3, (our_drift, their_drift)
