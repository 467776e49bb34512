"""Runs one benchmark on a base commit and on the working tree, alternating, and prints ratios.

    python benchmarks/compare_commits.py BASE_REF BENCHMARK [--rounds N] [-- BENCHMARK ARGS...]

The base commit is checked out into a temporary ``git worktree``. Each round
runs the benchmark once in each tree, as a fresh subprocess, alternating
which goes first; each run writes ``benchmarks/results/<BENCHMARK>.json`` in
its own tree. The table gives, per metric present in both, the median over
rounds for each tree and the ratio new/base: side by side in one run, so a
machine that drifts 2x between minutes moves both columns alike. The working
tree's own result file is restored afterwards; the comparison is written to
``benchmarks/results/compare_<BENCHMARK>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._report import Metric, report  # noqa: E402


def _run(tree: Path, benchmark: str, args: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run(
        [sys.executable, f"benchmarks/{benchmark}.py", *args], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL
    )
    return json.loads((tree / "benchmarks" / "results" / f"{benchmark}.json").read_text())["metrics"]


def compare(base_ref: str, benchmark: str, rounds: int, args: list[str]) -> dict[str, list[dict[str, float]]]:
    """Metrics per round for each tree (``base``, ``new``)."""
    saved = ROOT / "benchmarks" / "results" / f"{benchmark}.json"
    kept = saved.read_bytes() if saved.exists() else None
    scratch = Path(tempfile.mkdtemp(prefix="prefill-base-"))
    base = scratch / "tree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(base), base_ref], cwd=ROOT, check=True, capture_output=True
    )
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    try:
        for r in range(rounds):
            for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
                runs[name].append(_run(base if name == "base" else ROOT, benchmark, args))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
        shutil.rmtree(scratch, ignore_errors=True)
        if kept is not None:
            saved.write_bytes(kept)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_ref")
    parser.add_argument("benchmark", help="a script name in benchmarks/, without .py")
    parser.add_argument("--rounds", type=int, default=5)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ns = parser.parse_args(argv[:cut])
    runs = compare(ns.base_ref, ns.benchmark, ns.rounds, argv[cut + 1 :])
    shared = [k for k in runs["new"][0] if k in runs["base"][0]]
    metrics = []
    for key in shared:
        base = statistics.median(run[key] for run in runs["base"])
        new = statistics.median(run[key] for run in runs["new"])
        ratios = [n[key] / b[key] for n, b in zip(runs["new"], runs["base"]) if b[key]]
        note = f"base {base:.4g}, new {new:.4g}; paired ratios {min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""
        metrics.append(Metric(f"{key}.new_over_base", new / base if base else float("nan"), "x", note=note))
    print(f"{ns.benchmark}: {ns.rounds} alternating rounds, base {ns.base_ref} vs the working tree")
    report(f"compare_{ns.benchmark}", metrics)


if __name__ == "__main__":
    main()
