"""Writes ``benchmarks/README.md`` from ``benchmarks/results/*.json``: one table per JSON, never a hand-copied figure.

Each table names the command that wrote its JSON and the CPU capability the
JSON recorded (``_report.write_json`` records both); where a JSON predates
that and lacks one, the table says so rather than guess. The GPU first
contact's slot holds ``device_check.table`` of ``results/device_check.json``
once a session with a device has stored one there.

    python benchmarks/report_readme.py            # rewrite benchmarks/README.md
    python benchmarks/report_readme.py --check    # exit 1 when it is stale against the JSON
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
DEVICE_CHECK_BEGIN = "<!-- device-check table: begin -->"
DEVICE_CHECK_END = "<!-- device-check table: end -->"
DEVICE_CHECK_JSON = "device_check.json"

HEAD = """# Benchmarks

Written by `python benchmarks/report_readme.py` from `benchmarks/results/*.json`
(`make bench` runs every benchmark, then it); edit the scripts, never this
page (`tests/docs/test_benchmarks_readme.py` fails when it is stale). Each
script prints a table and writes `benchmarks/results/<name>.json`. These
machines are shared and noisy (2 cores), so comparisons are measured side by
side in one run, interleaved, as medians and ratios;
`python benchmarks/compare_commits.py BASE BENCHMARK` runs a benchmark on a
base commit's worktree and on the working tree in alternating rounds (its
JSON is `compare_<benchmark>.json`). A JSON written before the command and
the machine were recorded says so in its table.
"""

DEVICE_CHECK = """## GPU first contact: `scripts/device-check.sh`

One prepared script for the first session that is lent a CUDA device (an
H200 through the device tool), sized to about 4 minutes so a rerun fits a
15-minute device budget:

1. here, once: `scripts/device-check.sh --fetch-wheels` puts the cattrs
   wheel into `.whl/` (git-ignored; the device machine has torch, numpy 2.x,
   transformers, safetensors, attrs, pytest and hypothesis, but no cattrs,
   gguf or this project's venv, and no network);
2. on the device: command `scripts/device-check.sh`, carry `[".whl"]`,
   timeout 360 s. It installs the carried wheels into `/tmp/site`, runs the
   CUDA-marked tests (`pytest -m cuda tests`; `tests/tt` is never
   collected, so ttnn is never imported), then `benchmarks/device_check.py`;
   it writes `$OUT/device_check.json`, `.md` and a log;
3. here: `python benchmarks/device_check.py --readme <files_at>/device_check.json`
   stores that JSON as `benchmarks/results/device_check.json` and
   regenerates this page, whose table below it fills.

Without CUDA the script is a dry run: the CUDA-marked tests skip, the same
benchmark flow runs on the CPU with the tiny preset, and it exits 0 saying
it skipped.
"""

NO_DEVICE_RUN = """No session has had a CUDA device yet: no `benchmarks/results/device_check.json`,
so this table is empty until the first run of `scripts/device-check.sh` on one."""


def _script(name: str) -> str:
    """The script that writes ``<name>.json`` (``compare_X`` comes from compare_commits, ``warmup_*`` from warmup)."""
    if name.startswith("compare_"):
        return "compare_commits"
    for script in sorted(p.stem for p in HERE.glob("*.py")):
        if name == script or name.startswith(script + "_"):
            return script
    return name


def _command(name: str, result: dict) -> str:
    if "command" in result:
        return f"`{result['command']}`"
    script = _script(name)
    line = f"python benchmarks/{script}.py"
    if script == "compare_commits":
        line += f" BASE {name.removeprefix('compare_')}"
    return f"`{line}` (arguments not recorded in this JSON)"


def _machine(result: dict) -> str:
    machine = result.get("machine")
    if not isinstance(machine, dict) or "capability" not in machine:
        return "not recorded in this JSON"
    flags = [name for name in ("amx_tile", "avx512_bf16", "amx_fp16") if machine.get(name)]
    return f"{machine.get('device_type', 'cpu')}, {machine['capability']}" + (f" ({', '.join(flags)})" if flags else "")


def _about(script: str) -> str:
    """The first paragraph of the script's module docstring, on one line (read, not imported)."""
    path = HERE / f"{script}.py"
    if not path.exists():
        return ""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _value(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer():
        return f"{value:.0f}"
    return f"{value:.4g}"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(name: str, result: dict) -> str:
    """One benchmark's section: what the script measures, its command and machine, and every metric."""
    metrics, units = result.get("metrics", {}), result.get("units", {})
    targets, notes = result.get("targets", {}), result.get("notes", {})
    about = _about(_script(name))
    lines = [f"## {name}", ""]
    if about:
        lines += [about, ""]
    lines += [f"Command: {_command(name, result)}. CPU capability: {_machine(result)}.", ""]
    columns = ["metric", "value", "unit"] + (["target"] if targets else []) + (["note"] if notes else [])
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for key in sorted(metrics):
        cells = [f"`{key}`", _value(metrics[key]), units.get(key, "")]
        cells += [_value(targets[key]) if key in targets else ""] if targets else []
        cells += [notes.get(key, "")] if notes else []
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _device_check_table(results_dir: Path) -> str:
    path = results_dir / DEVICE_CHECK_JSON
    if not path.exists():
        return NO_DEVICE_RUN
    from benchmarks import device_check  # torch and the runtime: only once a device has run

    return device_check.table(json.loads(path.read_text()))


def render(results_dir: Path = RESULTS) -> str:
    """The whole page, from the JSON files in ``results_dir``."""
    sections = [
        HEAD,
        DEVICE_CHECK + f"\n{DEVICE_CHECK_BEGIN}\n{_device_check_table(results_dir)}\n{DEVICE_CHECK_END}\n",
    ]
    for path in sorted(results_dir.glob("*.json")):
        if path.name != DEVICE_CHECK_JSON:
            sections.append(table(path.stem, json.loads(path.read_text())) + "\n")
    return "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when benchmarks/README.md is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        stale = README.read_text() != page
        print(f"{README} is {'stale: run python benchmarks/report_readme.py' if stale else 'up to date'}")
        return int(stale)
    README.write_text(page)
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
