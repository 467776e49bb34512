"""What the lm-eval tests share: the repository root, one-thread runs there, and request-by-request comparison."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
LM_EVAL_OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
BATCH_SIZE = 8

MMLU_FEWSHOT = 2
"""The suite's prefill_mmlu runs 2 of the task's 5 few-shot examples: a ~160-token shared preamble (the subject
description and two worked questions) over all 100 documents, half the positions of the 5-shot task that
``benchmarks/scoring.py`` runs on SmolLM2."""
MMLU_MAX_LENGTH = 512
MMLU_POOL_BLOCKS = 20
"""The prefill-runtime pool: one row fits (about 11 blocks of 16), a round of BATCH_SIZE rows (about 40) does not."""


@contextlib.contextmanager
def at_repo_root_one_thread():
    """The task files name their data relative to the repository root; one torch thread, since on a shared
    2-core machine intra-op threads spin-wait and run several times slower."""
    previous, threads = Path.cwd(), torch.get_num_threads()
    os.chdir(REPO)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        os.chdir(previous)
        torch.set_num_threads(threads)


def responses(results, task: str) -> list[list]:
    """Per document (doc_id order), each request's response as a tuple."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[tuple(r) if isinstance(r, (list, tuple)) else (r,) for r in s["resps"]] for s in samples]


def assert_log_likelihoods_equal(mine: list[list], theirs: list[list], choices: int | None = None) -> None:
    """Request by request: log-likelihoods within 1e-4 plus 1e-5 of their size, and is_greedy flags equal
    (``choices`` per document). The relative part is float32 attention summed in another order than torch's
    (the CPU kernel of reference/cpu_kernels): as close to float64 as torch's, not bit-equal to it, and a
    continuation's log-likelihood sums tens of token log-probabilities through the whole model."""
    assert len(mine) == len(theirs)
    for doc, (a, b) in enumerate(zip(mine, theirs)):
        assert len(a) == len(b) and (choices is None or len(a) == choices), doc
        for x, y in zip(a, b):
            (ll_a, greedy_a), (ll_b, greedy_b) = (
                (x[0] if isinstance(x[0], tuple) else x),
                (y[0] if isinstance(y[0], tuple) else y),
            )
            assert abs(ll_a - ll_b) <= 1e-4 + 1e-5 * abs(ll_b), (doc, ll_a, ll_b)
            assert greedy_a == greedy_b, doc


def mmlu_evaluate(evaluator, task_manager, lm):
    """prefill_mmlu through ``simple_evaluate`` on ``lm`` with the suite's few-shot count, samples logged."""
    with at_repo_root_one_thread():
        return evaluator.simple_evaluate(
            model=lm,
            tasks=["prefill_mmlu"],
            task_manager=task_manager,
            num_fewshot=MMLU_FEWSHOT,
            log_samples=True,
        )
