"""Qwen2, Qwen3 and Mistral folders through every entry point: the CLI, the scorer, the serving facade.

(lm-eval on a Qwen3 folder is in ``test_lm_eval.py``, beside lm-eval's other tests.) Each result is
checked against transformers on the same folder.
"""

from __future__ import annotations

import pytest
import torch

from prefill_shell.cli.main import main
from prefill_shell.reference import load_hf_folder
from tests.e2e.test_scheduler import make_requests, run, serving_facade
from tests.family_kit import FamilyOracle, family_checkpoint, hf_model, relative_error
from tests.scoring.test_scorer import _hf_score, _pairs, _scorer

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One random checkpoint folder per family."""
    return {f: family_checkpoint(f, tmp_path_factory.mktemp(f), seed=3) for f in ("qwen2", "qwen3", "mistral")}


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_cli_run_on_a_family_folder_prints_transformers_top_log_probs(family, folders, tmp_path, capsys, kit):
    """``run --model FOLDER --token-ids``: each row's printed top-5 next tokens are transformers' top 5."""
    rows = [kit.make_tokens(n, seed).tolist() for n, seed in ((37, 1), (5, 2))]
    ids = tmp_path / "ids.txt"
    ids.write_text("".join(" ".join(map(str, row)) + "\n" for row in rows))
    main(["run", "--model", str(folders[family]), "--token-ids", str(ids)])
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("row "))
    hf = hf_model(folders[family], torch.float32)
    for row, line in zip(rows, lines[header + 1 : header + 1 + len(rows)]):
        words = line.split()
        printed = [(int(words[i].lstrip("#")), float(words[i + 1])) for i in range(3, 13, 2)]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([row])).logits[0, -1].float(), dim=-1)
        best = torch.topk(logp, 5)
        assert [token for token, _ in printed] == best.indices.tolist(), line
        assert all(abs(value - want) <= 0.005 for (_, value), want in zip(printed, best.values.tolist())), line


def test_scorer_on_a_qwen3_folder_equals_transformers(folders, kit):
    """The scorer's log-likelihoods within 1e-4 and is_greedy equal transformers' on a Qwen3 folder."""
    model, hf = load_hf_folder(folders["qwen3"]), hf_model(folders["qwen3"], torch.float32)
    pairs = _pairs(kit)
    scores = _scorer(model, 16).score(pairs)
    for (context, continuation), score in zip(pairs, scores):
        logprob, greedy = _hf_score(hf, context, continuation)
        assert abs(score.logprob - logprob) <= 1e-4 and score.is_greedy == greedy


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_serving_facade_under_the_scheduler_equals_transformers_on_a_qwen2_folder(folders, kit, traced):
    """The vLLM-like scheduler drives the facade over a Qwen2 model: every final-chunk logit equals transformers'
    (1e-4 relative), with chunk ends inside blocks and prefix hits."""
    model = load_hf_folder(folders["qwen2"])
    oracle = FamilyOracle(hf_model(folders["qwen2"], torch.float32))
    requests = make_requests(kit, count=12)
    facade = serving_facade(model, kit, traced=traced, sampled=False, budget=256)
    stats = run(facade, requests, budget=256, traced=traced, sampled=False)
    facade.cleanup()
    for request in requests:
        assert request.results, request.id
        expected = oracle.run(request.tokens)[0][-1]
        for logits in request.results:
            assert relative_error(logits, expected) <= 1e-4, (traced, request.id)
    assert stats["unaligned_starts"] and stats["prefix_hit_blocks"], stats
