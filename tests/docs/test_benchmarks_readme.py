"""benchmarks/README.md is what ``benchmarks/report_readme.py`` writes from results/*.json, and says what they lack."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report_readme


def test_benchmarks_readme_is_not_stale_against_the_json():
    """Regenerated in memory, the page equals the committed one: run ``python benchmarks/report_readme.py`` if not."""
    assert report_readme.README.read_text() == report_readme.render(), "run python benchmarks/report_readme.py"


def test_every_result_has_a_table_naming_its_command_and_machine_or_saying_they_were_not_recorded():
    """One section per JSON; a JSON without ``command`` / ``machine`` gets 'not recorded', never a guess."""
    page = report_readme.render()
    for path in sorted(report_readme.RESULTS.glob("*.json")):
        if path.name == report_readme.DEVICE_CHECK_JSON:
            continue
        result = json.loads(path.read_text())
        section = page.split(f"\n## {path.stem}\n", 1)[1].split("\n## ", 1)[0]
        line = next(line for line in section.splitlines() if line.startswith("Command: "))
        assert (result["command"] in line) if "command" in result else ("arguments not recorded" in line)
        capability = result.get("machine", {}).get("capability")
        assert (capability in line) if capability else line.endswith("CPU capability: not recorded in this JSON.")
        for key, value in result["metrics"].items():
            assert f"| `{key}` | {report_readme._value(value)} |" in section


def test_a_json_with_command_machine_targets_and_notes_shows_them(tmp_path: Path):
    """What ``_report.write_json`` records now (command, CPU capability, targets, notes) reaches the table."""
    result = {
        "benchmark": "plan_cost",
        "command": "python benchmarks/plan_cost.py --quick",
        "machine": {"device_type": "cpu", "capability": "AVX512", "amx_tile": True},
        "metrics": {"ratio_a": 1.5, "count_b": 3},
        "units": {"ratio_a": "ratio", "count_b": "count"},
        "targets": {"ratio_a": 2.0},
        "notes": {"count_b": "3 steps"},
    }
    (tmp_path / "plan_cost.json").write_text(json.dumps(result))
    page = report_readme.render(tmp_path)
    assert "Command: `python benchmarks/plan_cost.py --quick`. CPU capability: cpu, AVX512 (amx_tile)." in page
    assert "| `count_b` | 3 | count |  | 3 steps |" in page and "| `ratio_a` | 1.5 | ratio | 2 |  |" in page
    assert report_readme.NO_DEVICE_RUN in page  # no device_check.json: the slot says so
