"""benchmarks/device_check.py, the GPU first contact, runs its whole flow on the CPU (its dry run) and fills the README.

The CUDA run itself needs a device; here its code is exercised on the tiny
preset so the device minutes are not spent finding its bugs.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")
from benchmarks import device_check, report_readme


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

    results = tmp_path / "results"  # the JSON stored where --readme stores it: the generated page's slot shows it
    results.mkdir()
    shutil.copyfile(tmp_path / "device_check_dry_run.json", results / report_readme.DEVICE_CHECK_JSON)
    page = report_readme.render(results)
    slot = page.split(report_readme.DEVICE_CHECK_BEGIN, 1)[1].split(report_readme.DEVICE_CHECK_END, 1)[0]
    assert "| tiny | bfloat16 | 2x32 |" in slot and report_readme.NO_DEVICE_RUN not in page
