"""``prefill-run --model FOLDER`` and ``prefill-score --model FOLDER`` on folders transformers slides.

A Gemma 3 folder (``Gemma3ForCausalLM``), a sliding-window Mistral and a
Qwen3 hybrid (sliding and full layers), each a random checkpoint written by
transformers' own config and model classes (``save_pretrained``), with a
window of 8 tokens and 16-token blocks, so prompts cross windows, blocks and
a shared prefix. ``run`` prints each row's five most likely next tokens and
their log-probs; ``score`` each pair's log-likelihood: both equal
transformers' on the same folder (to the digits printed). The commands used
to load only full-attention folders (``load_hf_folder``'s "unsupported").
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from prefill_shell.cli.main import main
from prefill_shell.scoring.scorer import encode_pair
from tests import family_kit, gemma3_kit

transformers = pytest.importorskip("transformers")

WINDOW = 8
BLOCK = "16"
FOLDERS = ("gemma3", "mistral-window", "qwen3-hybrid")


def _save(name: str, folder) -> None:
    if name == "gemma3":
        hf = transformers.Gemma3ForCausalLM(gemma3_kit.text_config(WINDOW)).eval().float()
        gemma3_kit.randomize(hf, 11)
        hf.save_pretrained(folder)
    elif name == "mistral-window":
        family_kit.family_checkpoint("mistral", folder, seed=11, sliding_window=WINDOW)
    else:
        types = ["sliding_attention", "full_attention"]
        family_kit.family_checkpoint(
            "qwen3", folder, seed=11, use_sliding_window=True, sliding_window=WINDOW, layer_types=types
        )


@pytest.fixture(scope="module", params=FOLDERS)
def folder(request, tmp_path_factory):
    """``(name, folder)``: the family's random checkpoint, no tokenizer files."""
    path = tmp_path_factory.mktemp(request.param)
    _save(request.param, path)
    return request.param, path


def _oracle(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _log_probs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_run_on_a_sliding_folder_prints_transformers_next_tokens(folder, tmp_path, capsys):
    """Two prompts sharing two blocks: each row's top-5 next tokens and log-probs are transformers'."""
    name, path = folder
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 250, (32,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 250, (n,), generator=gen).tolist() for n in (9, 14)]
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("\n".join(" ".join(map(str, p)) for p in prompts) + "\n")
    main(["run", "--model", str(path), "--token-ids", str(ids_file), "--block-size", BLOCK, "--debug"])
    out = capsys.readouterr().out.splitlines()
    hf = _oracle(path)
    rows = [line for line in out[1:] if line.split() and line.split()[0].isdigit()]
    assert len(rows) == len(prompts), out
    for row, prompt in zip(rows, prompts):
        printed = [(int(t), float(lp)) for t, lp in re.findall(r"#(\d+) (-?\d+\.\d+)", row)][:5]
        expected = torch.topk(_log_probs(hf, prompt)[-1], 5)
        assert [t for t, _ in printed] == expected.indices.tolist(), (name, row)
        assert all(abs(lp - e) <= 0.006 for (_, lp), e in zip(printed, expected.values.tolist())), (name, row)


def _char_tokenizer():
    """A character-level tokenizer (ids 2..96 for printable ASCII, BOS 1) that every tiny vocabulary holds."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>")


def test_score_on_a_sliding_folder_prints_transformers_log_likelihoods(folder, tmp_path, capsys):
    """Three continuations of one context longer than the window: each log-likelihood is transformers'."""
    import json

    name, source = folder
    path = tmp_path / "model"
    shutil.copytree(source, path)
    tokenizer = _char_tokenizer()
    tokenizer.save_pretrained(path)
    context = "The capital of France is a city on the Seine with many museums. It is"
    pairs = [(context, c) for c in (" Paris", " London", " a small village")]
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("\n".join(json.dumps({"context": c, "continuation": x}) for c, x in pairs) + "\n")
    main(["score", "--model", str(path), "--pairs", str(pairs_file), "--block-size", BLOCK, "--debug"])
    out = capsys.readouterr().out.splitlines()
    printed = [float(line.split()[3]) for line in out[1 : 1 + len(pairs)]]
    hf = _oracle(path)
    for (c, x), value in zip(pairs, printed):
        ctx, cont = encode_pair(tokenizer, c, x)
        lp = _log_probs(hf, ctx + cont)
        expected = sum(float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
        assert abs(value - expected) <= 1e-3, (name, x, value, expected)


def test_dtype_auto_reads_a_sliding_folder_checkpoint_dtype(folder):
    """``--dtype auto`` reads the folder's dtype through the loader that serves it (it was refused as unsupported)."""
    from prefill_shell.reference.loading.text import model_dtype

    assert model_dtype(str(folder[1]), "auto").dtype == "float32"


def test_lm_evals_model_on_a_sliding_folder_scores_as_transformers(folder, tmp_path):
    """``prefill-runtime`` (lm-eval's model) on each sliding folder: loglikelihood equals transformers' (it was
    the plain loader's refusal naming load_model_folder)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    name, source = folder
    path = tmp_path / "model"
    shutil.copytree(source, path)
    tokenizer = _char_tokenizer()
    tokenizer.save_pretrained(path)
    lm = PrefillRuntimeLM(model=str(path), max_length=96, block_size=int(BLOCK), max_chunk=64)
    context, continuation = "The capital of France is a city on the Seine. It is", " Paris"
    request = Instance("loglikelihood", {}, (context, continuation), 0)
    ((value, _),) = lm.loglikelihood([request])
    ctx, cont = encode_pair(tokenizer, context, continuation)
    lp = _log_probs(_oracle(path), ctx + cont)
    expected = sum(float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
    assert abs(value - expected) <= 1e-3, (name, value, expected)
