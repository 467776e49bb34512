"""The scoring API: continuation log-likelihoods and is_greedy equal transformers', contexts computed once."""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout
from prefill_shell.scoring.scorer import BlockPool, Scorer, rolling_windows
from tests.helpers import build_runtime


def _scorer(model, block_size: int, **kwargs) -> Scorer:
    """A scorer on the CPU backend's preferred policy (fine rungs: a short follow-up row computes little)."""
    layout = PageTableLayout(block_size, 512 // block_size, 1024 // block_size)
    return Scorer(build_runtime(model, layout=layout), **kwargs)


def _hf_score(hf, context, continuation) -> tuple[float, bool]:
    tokens = torch.tensor(list(context) + list(continuation))
    with torch.no_grad():
        logp = torch.log_softmax(hf(tokens[None]).logits[0].float(), dim=-1)
    positions = range(len(context) - 1, len(tokens) - 1)
    total = sum(logp[p, tokens[p + 1]].item() for p in positions)
    return total, all(int(logp[p].argmax()) == int(tokens[p + 1]) for p in positions)


def _pairs(kit):
    """Contexts of 100, 64 (block aligned), 33 and 1 tokens, four continuations of 1..6 tokens each."""
    pairs = []
    for n, seed in ((100, 1), (64, 2), (33, 3), (1, 4)):
        context = kit.make_tokens(n, seed).tolist()
        for j in range(4):
            pairs.append((context, kit.make_tokens(1 + (j * 5 + seed) % 6, 10 * seed + j).tolist()))
    return pairs


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_scores_equal_transformers_and_contexts_run_once(tiny_model, oracle, kit, block_size, traced):
    """Every pair's log-likelihood within 1e-4 and is_greedy equal; fewer positions than one row per pair."""
    pairs = _pairs(kit)
    scorer = _scorer(tiny_model, block_size, mode="traced" if traced else "eager")
    scores = scorer.score(pairs)
    for (context, continuation), score in zip(pairs, scores):
        logprob, greedy = _hf_score(oracle.hf, context, continuation)
        assert abs(score.logprob - logprob) <= 1e-4 and score.is_greedy == greedy
        assert score.num_tokens == len(continuation)
    assert scorer.pool.available == scorer.pool.size  # every block went back
    no_reuse = sum(len(c) + len(x) for c, x in pairs)
    assert scorer.positions_computed < no_reuse
    if not traced:  # packed steps: every context once (its whole blocks cached, its tail a shared span of its first
        # pair), then each pair's continuation, and each later pair's last context token, which scores its first
        contexts: dict[tuple, list] = {}
        for context, continuation in pairs:
            contexts.setdefault(tuple(context), []).append(continuation)
        once = sum(len(c) + sum(map(len, xs)) + len(xs) - 1 for c, xs in contexts.items())
        assert scorer.positions_computed == once


def test_a_greedy_continuation_is_greedy(tiny_model, oracle, kit):
    """A continuation built from the model's own argmax tokens is scored greedy."""
    context = kit.make_tokens(40, 5).tolist()
    tokens = list(context)
    for _ in range(3):
        with torch.no_grad():
            tokens.append(int(oracle.hf(torch.tensor(tokens)[None]).logits[0, -1].argmax()))
    (score,) = _scorer(tiny_model, 16).score([(context, tokens[40:])])
    assert score.is_greedy and score.num_tokens == 3


def test_max_length_truncates_from_the_left_like_lm_eval(tiny_model, oracle, kit):
    """With max_length, context + continuation keeps its last max_length + 1 tokens."""
    context, continuation = kit.make_tokens(90, 6).tolist(), kit.make_tokens(5, 7).tolist()
    (score,) = _scorer(tiny_model, 16, max_length=50).score([(context, continuation)])
    want, _ = _hf_score(oracle.hf, (context + continuation)[-51:-5], continuation)
    assert abs(score.logprob - want) <= 1e-4


def test_rolling_scores_sum_the_windows(tiny_model, oracle, kit):
    """A document several windows long: the sum over lm-eval's windows, each scored as a pair."""
    document = kit.make_tokens(150, 8).tolist()
    scorer = _scorer(tiny_model, 16, max_length=40)
    (total,) = scorer.score_rolling([document], prefix_token=1)
    windows = rolling_windows(document, 1, 40)
    assert len(windows) == 4 and [t for _, w in windows for t in w] == document
    assert abs(total - sum(_hf_score(oracle.hf, c, w)[0] for c, w in windows)) <= 1e-4


def _calls(scorer: Scorer) -> list[int]:
    """The row count of every prefill call ``scorer`` makes from now on (a spy around its one call site)."""
    rows, prefill = [], scorer._prefill

    def counted(tokens, *args):
        rows.append(tokens.shape[0])
        return prefill(tokens, *args)

    scorer._prefill = counted
    return rows


@pytest.mark.parametrize(("max_rows", "pool_blocks"), [(4, None), (32, 13)], ids=["max_rows", "small-pool"])
def test_a_sharing_group_larger_than_a_round_runs_in_rounds_with_the_same_scores(
    tiny_model, oracle, kit, max_rows, pool_blocks
):
    """40 pairs over one 100-token context: rounds of at most max_rows follow-ups (plus the shared context row),
    each within the pool, and every score equal to transformers' (one 41-row call, or a CapacityError, before)."""
    context = kit.make_tokens(100, 11).tolist()
    pairs = [(context, kit.make_tokens(1 + j % 5, 200 + j).tolist()) for j in range(40)]
    pool = None if pool_blocks is None else BlockPool(range(pool_blocks))
    scorer = _scorer(tiny_model, 16, max_rows=max_rows, pool=pool)
    calls = _calls(scorer)
    scores = scorer.score(pairs)
    assert len(calls) > 1 and max(calls) <= min(max_rows, pool_blocks or max_rows) + 1, calls
    for (ctx, continuation), score in zip(pairs, scores):
        logprob, greedy = _hf_score(oracle.hf, ctx, continuation)
        assert abs(score.logprob - logprob) <= 1e-4 and score.is_greedy == greedy
    assert scorer.pool.available == scorer.pool.size


def test_an_empty_context_is_conditioned_on_bos_as_lm_eval_does(smollm2_tokenizer):
    """encode_pair("", x) is ([BOS], x without special tokens), as lm-eval's TemplateLM.loglikelihood; a continuation
    that already begins with BOS gives that token as the context. Before: ([], ...), refused by the Scorer."""
    from prefill_shell.scoring.scorer import encode_pair, prefix_token_id

    tok = smollm2_tokenizer
    bos = tok.bos_token_id
    assert prefix_token_id(tok) == bos
    plain = tok.encode(" Paris", add_special_tokens=False)
    assert encode_pair(tok, "", " Paris") == ([bos], plain)
    assert encode_pair(tok, "  ", "Paris") == ([bos], tok.encode("  Paris", add_special_tokens=False))
    assert encode_pair(tok, "", tok.bos_token + " Paris") == ([bos], plain)
