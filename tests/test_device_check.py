"""benchmarks/device_check.py, the GPU first contact, runs its whole flow on the CPU (its dry run) and fills the README.

The CUDA run itself needs a device; here its code is exercised on the tiny
preset so the device minutes are not spent finding its bugs.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
from benchmarks import device_check


def test_dry_run_checks_traced_against_eager_and_transformers_and_writes_a_table(monkeypatch, tmp_path):
    """One model and case: traced equals the same plan eagerly, ours agrees with HF, rates are positive."""
    monkeypatch.setattr(device_check, "DRY_RUNS", (("tiny", "bfloat16"),))
    monkeypatch.setattr(device_check, "DRY_CASES", {"2x32": [32, 32]})
    device_check.main(["--dry-run", "--budget-s", "0", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "device_check_dry_run.json").read_text())
    (row,) = result["rows"]
    assert (row["model"], row["dtype"], row["case"]) == ("tiny", "bfloat16", "2x32")
    assert row["traced_identical"] == 1.0 and row["eager_vs_traced_logit_diff"] < 0.125
    assert row["hf_argmax_agree"] == 1.0 and row["hf_logit_diff"] < 0.125
    assert min(row["eager_tok_s"], row["traced_tok_s"], row["hf_tok_s"]) > 0 and row["rounds"] == 3
    assert result["environment"]["numerics"]["device_type"] == "cpu"
    assert "| tiny | bfloat16 | 2x32 |" in (tmp_path / "device_check_dry_run.md").read_text()

    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{device_check.BEGIN}\nold table\n{device_check.END}\ntail\n")
    device_check.write_readme(tmp_path / "device_check_dry_run.json", readme)
    text = readme.read_text()
    assert "old table" not in text and "| tiny | bfloat16 | 2x32 |" in text
    assert text.startswith("head\n") and text.endswith(f"{device_check.END}\ntail\n")
