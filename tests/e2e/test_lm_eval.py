"""lm-eval's simple_evaluate on prefill-runtime equals lm-eval's own hf model on the same SmolLM2 GGUF."""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.lm_eval_kit import (
    BATCH_SIZE,
    LM_EVAL_OFFLINE,
    MMLU_FEWSHOT,
    MMLU_MAX_LENGTH,
    MMLU_POOL_BLOCKS,
    REPO,
    assert_log_likelihoods_equal,
    at_repo_root_one_thread,
    mmlu_evaluate,
    responses,
)
from tests.model_fixtures import smollm2_loads_reused

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="lm-eval is tested on 3.12")


MAX_LENGTH = 128
"""Both models' lm-eval max_length: the rolling document (about 1,000 tokens) runs as several windows."""
MAX_CHUNK = 64
"""The runtime's longest step, below MAX_LENGTH: windows and contexts run in several chunks."""


@pytest.fixture(scope="module")
def both_runs(lm_eval_harness, smollm2_file, smollm2, smollm2_hf, smollm2_tokenizer):
    """(prefill-runtime results, hf results) of one simple_evaluate each: same tasks, max_length, batch size.

    lm-eval's ``hf`` model is its ``HFLM`` class around transformers' Llama loaded from the same GGUF by
    transformers itself (the session's ``smollm2_hf``: the load is shared with the other SmolLM2 tests).
    prefill-runtime is lm-eval's registered model built from its ``model_args`` string; its loads of the file
    return the session's ``smollm2`` and ``smollm2_tokenizer`` (``smollm2_loads_reused``: the same calls on the
    same file); the command-line test below loads the file afresh in its own process.
    """
    from lm_eval.models.huggingface import HFLM

    evaluator, task_manager = lm_eval_harness
    gguf = Path(smollm2_file)
    common = dict(
        tasks=["prefill_mc", "prefill_rolling"],
        batch_size=BATCH_SIZE,
        task_manager=task_manager,
        log_samples=True,
    )
    with at_repo_root_one_thread():
        with smollm2_loads_reused(gguf, smollm2, smollm2_tokenizer) as served:
            ours = evaluator.simple_evaluate(
                model="prefill-runtime",
                model_args=f"model={gguf},max_length={MAX_LENGTH},max_chunk={MAX_CHUNK},block_size=16",
                **common,
            )
        assert served == ["weights", "tokenizer"]
        hf = HFLM(pretrained=smollm2_hf, tokenizer=smollm2_tokenizer, max_length=MAX_LENGTH, batch_size=BATCH_SIZE)
        theirs = evaluator.simple_evaluate(model=hf, **common)
    return ours, theirs


def test_multiple_choice_log_likelihoods_greedy_flags_and_accuracy_equal_hf(both_runs):
    """Every request's log-likelihood within 1e-4, every is_greedy equal, the same accuracy, below 100%."""
    ours, theirs = both_runs
    mine, hf = responses(ours, "prefill_mc"), responses(theirs, "prefill_mc")
    assert len(mine) >= 20
    assert_log_likelihoods_equal(mine, hf, choices=4)
    acc = ours["results"]["prefill_mc"]["acc,none"]
    assert acc == theirs["results"]["prefill_mc"]["acc,none"] and acc < 1.0


def test_rolling_log_likelihood_equals_hf_over_several_windows(both_runs):
    """The document's rolling log-likelihood within 1e-6 relative of hf's, with windows (max_length) and chunks
    (max_chunk): a sum of ~1,000 float32 log-probs near -1000, where one float32 step of the sum is 6e-5."""
    ours, theirs = both_runs
    (mine,), (hf,) = responses(ours, "prefill_rolling"), responses(theirs, "prefill_rolling")
    ll_a, ll_b = mine[0][0], hf[0][0]
    assert math.isclose(ll_a, ll_b, rel_tol=1e-6), (ll_a, ll_b)
    assert math.isclose(
        ours["results"]["prefill_rolling"]["word_perplexity,none"],
        theirs["results"]["prefill_rolling"]["word_perplexity,none"],
        rel_tol=1e-6,
    )


def test_rolling_windows_match_lm_evals_own(lm_eval_harness):
    """scoring.rolling_windows (the API's own, for Pythons without lm-eval) cuts what lm-eval cuts."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from prefill_shell.scoring.scorer import rolling_windows

    for length in (1, 5, 127, 128, 129, 300, 1000):
        for max_length in (1, 2, 16, 128):
            tokens = list(range(100, 100 + length))
            want = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 7, max_length, 1)]
            assert rolling_windows(tokens, 7, max_length) == [(list(c), list(x)) for c, x in want]


def test_generate_until_raises_a_clear_error(lm_eval_harness):
    """prefill-runtime does not generate: generate_until names what it does instead."""
    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    with pytest.raises(NotImplementedError, match="prefill engine"):
        PrefillRuntimeLM.generate_until(None, [])


def _readme_command() -> list[str]:
    """docs/scoring.md's lm-eval command line, as argv (its environment assignments dropped, python this one)."""
    text = (REPO / "docs" / "scoring.md").read_text()
    line = next(line for line in text.splitlines() if "python -m prefill_shell.cli.lm_eval_harness --model" in line)
    words = shlex.split(line)
    while "=" in words[0]:  # leading VAR=value assignments
        words.pop(0)
    return [sys.executable, *words[1:]]


def test_the_readme_command_runs_lm_evals_cli_with_prefill_runtime(lm_eval_harness, smollm2_file):
    """docs/scoring.md's command (plus --limit 4) registers prefill-runtime and prints lm-eval's results table."""
    command = _readme_command()
    assert command[1:5] == ["-m", "prefill_shell.cli.lm_eval_harness", "--model", "prefill-runtime"]
    env = {
        **os.environ,
        **LM_EVAL_OFFLINE,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([*command, "--limit", "4"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "prefill_mc" in done.stdout and "acc" in done.stdout


# -- an MMLU-shaped task whose every context shares one ~300-token preamble, on a pool smaller than a round ----


def test_an_mmlu_shaped_task_on_a_pool_smaller_than_a_round_equals_hf(
    lm_eval_harness, tiny_smollm2_vocab, mmlu_hf_reference
):
    """prefill_mmlu (a shared description and few-shot examples over 100 documents) through lm-eval with
    prefill-runtime's model arguments and a pool smaller than a round: every log-likelihood within 1e-4 of lm-eval's
    hf model, is_greedy and accuracy equal; the scorer ran it in rounds that each fit the pool (before: one
    400-row group, CapacityError)."""
    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    evaluator, task_manager = lm_eval_harness
    folder, _ = tiny_smollm2_vocab
    args = f"model={folder},max_length={MMLU_MAX_LENGTH},block_size=16,num_blocks={MMLU_POOL_BLOCKS}"
    ours_lm = PrefillRuntimeLM.create_from_arg_string(f"{args},batch_size={BATCH_SIZE}")
    rounds, prefill = [], ours_lm.scorer._prefill
    ours_lm.scorer._prefill = lambda tokens, *rest: rounds.append(tokens.shape[0]) or prefill(tokens, *rest)
    ours = mmlu_evaluate(evaluator, task_manager, ours_lm)
    mine, hf = responses(ours, "prefill_mmlu"), responses(mmlu_hf_reference, "prefill_mmlu")
    assert len(mine) == 100
    sample = ours["samples"]["prefill_mmlu"][0]
    context = sample["arguments"][0][0]
    assert context.count("Answer:") == MMLU_FEWSHOT + 1  # the few-shot examples and the question
    assert len(ours_lm.tok_encode(context)) >= 150  # the shared preamble plus one question
    one_row = -(-(len(ours_lm.tok_encode(context)) + 2) // 16)
    assert one_row <= MMLU_POOL_BLOCKS < 2 * one_row  # one row fits; two unshared rows, let alone a round, do not
    assert_log_likelihoods_equal(mine, hf)
    assert ours["results"]["prefill_mmlu"]["acc,none"] == mmlu_hf_reference["results"]["prefill_mmlu"]["acc,none"]
    assert len(rounds) > 400 // BATCH_SIZE and max(rounds) <= BATCH_SIZE + 1  # the pool, not max_rows, cut them
    assert ours_lm.scorer.pool.available == MMLU_POOL_BLOCKS


# -- a Qwen3 random folder: the loader's families through lm-eval, against lm-eval's hf model -----------


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory, smollm2_tokenizer):
    """A random Qwen3 checkpoint (tiny, tied head, odd vocabulary covering SmolLM2's ids) with SmolLM2's
    tokenizer saved into it, so that both models load the folder offline."""
    from tests.family_kit import family_checkpoint

    folder = family_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_lm_eval"), vocab_size=49157)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


def test_qwen3_folder_log_likelihoods_equal_hf_request_by_request(lm_eval_harness, qwen3_folder):
    """prefill-runtime on a Qwen3 folder: each multiple-choice log-likelihood within 1e-4 of lm-eval's hf model on
    the same folder, each is_greedy equal; chunked (max_chunk 64 < max_length) like the SmolLM2 run."""
    from lm_eval.models.huggingface import HFLM

    from tests.family_kit import hf_model

    evaluator, task_manager = lm_eval_harness
    common = dict(tasks=["prefill_mc"], batch_size=BATCH_SIZE, task_manager=task_manager, log_samples=True, limit=10)
    with at_repo_root_one_thread():
        ours = evaluator.simple_evaluate(
            model="prefill-runtime",
            model_args=f"model={qwen3_folder},max_length={MAX_LENGTH},max_chunk={MAX_CHUNK},block_size=16",
            **common,
        )
        hf = HFLM(
            pretrained=hf_model(qwen3_folder, torch.float32),
            tokenizer=str(qwen3_folder),
            max_length=MAX_LENGTH,
            batch_size=BATCH_SIZE,
        )
        theirs = evaluator.simple_evaluate(model=hf, **common)
    mine = responses(ours, "prefill_mc")
    assert len(mine) == 10
    assert_log_likelihoods_equal(mine, responses(theirs, "prefill_mc"), choices=4)
