"""``python -m prefill_shell score``: per-pair log-likelihoods equal the Scorer's, contexts shared; bad input named.

Bad input is a pairs file whose line is malformed, holds values that are not strings or bytes that are not
UTF-8, a count flag below one or past the model's positions (each named, by line or by flag), and an empty
document, which scores zero.
"""

from __future__ import annotations

import argparse
import json

import pytest

from prefill_core.values.errors import InvalidScoringRequestError
from prefill_shell.cli import model_dtype
from prefill_shell.cli import score as score_cli
from prefill_shell.cli.main import main
from prefill_shell.cli.score import read_pairs


def test_a_malformed_pairs_file_names_its_line(tmp_path, capsys):
    """A line without 'continuation' is an InvalidScoringRequestError naming the file and line (one error line)."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"context": "a", "continuation": "b"}) + "\n" + json.dumps({"context": "a"}) + "\n")
    with pytest.raises(InvalidScoringRequestError, match=r"pairs.jsonl:2"):
        read_pairs(path)
    with pytest.raises(SystemExit) as exit_info:
        main(["score", "--model", "random:tiny", "--pairs", str(path)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pairs.jsonl:2" in err and "Traceback" not in err


def test_pairs_print_scores_and_positions_against_no_reuse(tmp_path, capsys, smollm2_file, smollm2_loaded_once):
    """Four continuations of one context: four lines, and fewer positions computed than one row per pair. The
    command loads the file as it would for a user; the weights and tokenizer are the session's (the same loads)."""
    context = "The capital of France is a city on the Seine with many museums, bridges and old churches. It is"
    rows = [{"context": context, "continuation": c} for c in (" Paris", " London", " Rome", " a small village")]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    main(["score", "--model", str(smollm2_file), "--pairs", str(path), "--max-length", "256"])
    assert smollm2_loaded_once == ["weights", "tokenizer"]
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines[1:5]]
    assert [int(r[0]) for r in table] == [0, 1, 2, 3]
    paris, london = float(table[0][3]), float(table[1][3])
    assert paris > london  # the model's own preference, a sanity check on the printed numbers
    computed, no_reuse = (int(w.strip("():")) for w in lines[-1].split() if w.strip("():").isdigit())
    assert computed < no_reuse


@pytest.mark.parametrize("item", [{"context": None, "continuation": 5}, {"context": "a", "continuation": ["b"]}])
def test_a_pair_whose_values_are_not_strings_names_its_line(tmp_path, item):
    """null, numbers and lists were scored as their str() ('None', '5', "['b']"): now the line is named."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"context": "a", "continuation": "b"}) + "\n" + json.dumps(item) + "\n")
    with pytest.raises(InvalidScoringRequestError, match=r"pairs.jsonl:2: .*strings"):
        read_pairs(path)


def test_a_pairs_file_that_is_not_utf8_is_named(tmp_path):
    """Bytes that are not UTF-8 name the file (a UnicodeDecodeError before, reported as unexpected)."""
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b'{"context": "a", "continuation": "b"}\n\xff\xfe\n')
    with pytest.raises(InvalidScoringRequestError, match=r"pairs.jsonl: is not UTF-8"):
        read_pairs(path)


@pytest.mark.parametrize(
    "flag, rule",
    [
        ("--max-length", "must be an integer >= 1"),
        ("--block-size", "must be a power of two"),
        ("--max-chunk", "must be an integer >= 1"),
    ],
)
def test_a_count_below_one_is_a_usage_error_naming_the_flag(tmp_path, capsys, flag, rule):
    """--max-length 0 silently meant the model's length and --block-size 0 divided by zero: now exit 2 naming it."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"context": "a", "continuation": "b"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["score", "--model", "random:tiny", "--pairs", str(path), flag, "0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: '0' {rule}" in capsys.readouterr().err


def test_a_max_length_past_the_models_positions_is_named_before_a_pool_is_sized(tmp_path, capsys):
    """--max-length 10**9 sized a KV pool for rows the core would refuse: now one error line naming the flag."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"context": "a", "continuation": "b"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["score", "--model", "random:tiny", "--pairs", str(path), "--max-length", str(10**9)])
    assert exit_info.value.code == 1
    assert "--max-length=1000000000 is invalid: must be <= " in capsys.readouterr().err


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
    monkeypatch.setattr(model_dtype, "load_model", lambda ref, dtype, device, **_: tiny_model)
    monkeypatch.setattr(score_cli, "load_tokenizer", lambda ref: _Tokenizer())
    score_cli.run_score(_score_args(tmp_path, text))
    out = capsys.readouterr().out
    assert "document: 0 tokens, log-likelihood 0.0000" in out, out


def test_an_empty_context_in_pairs_is_scored_on_bos(
    tmp_path, capsys, smollm2_file, smollm2_loaded_once, smollm2_tokenizer
):
    """score --pairs with context "" conditions on BOS (else EOS) as lm-eval and --document do: a one-token
    context, where it was refused with advice the command line cannot follow ("use a prefix token")."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"context": "", "continuation": "The capital of France is Paris"}) + "\n")
    main(["score", "--model", str(smollm2_file), "--pairs", str(path), "--max-length", "64"])
    row = capsys.readouterr().out.splitlines()[1].split()
    continuation = smollm2_tokenizer.encode("The capital of France is Paris", add_special_tokens=False)
    assert (int(row[1]), int(row[2])) == (1, len(continuation)) and float(row[3]) < 0
