"""`python -m prefill_shell score` under a careless caller: non-text pairs, non-UTF-8 files, bad counts named."""

from __future__ import annotations

import json

import pytest

from prefill_core.errors import InvalidScoringRequestError
from prefill_shell.cli.main import main
from prefill_shell.cli.score import read_pairs


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
