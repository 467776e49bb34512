"""``python -m prefill_shell score``: per-pair log-likelihoods equal the Scorer's, contexts shared; bad files named."""

from __future__ import annotations

import json

import pytest

from prefill_core.errors import InvalidScoringRequestError
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


def test_pairs_print_scores_and_positions_against_no_reuse(tmp_path, capsys, smollm2_file):
    """Four continuations of one context: four lines, and fewer positions computed than one row per pair."""
    context = "The capital of France is a city on the Seine with many museums, bridges and old churches. It is"
    rows = [{"context": context, "continuation": c} for c in (" Paris", " London", " Rome", " a small village")]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    main(["score", "--model", str(smollm2_file), "--pairs", str(path), "--max-length", "256"])
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines[1:5]]
    assert [int(r[0]) for r in table] == [0, 1, 2, 3]
    paris, london = float(table[0][3]), float(table[1][3])
    assert paris > london  # the model's own preference, a sanity check on the printed numbers
    computed, no_reuse = (int(w.strip("():")) for w in lines[-1].split() if w.strip("():").isdigit())
    assert computed < no_reuse
