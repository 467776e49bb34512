"""Shared benchmark output: a printed table and ``benchmarks/results/<name>.json``.

The JSON is ``{"benchmark": name, "metrics": {key: value}, "units": {key: unit}}``, plus ``"command"`` (the
command line that ran), ``"machine"`` (the CPU's capability and bfloat16 facts, ``DeviceNumerics.as_dict``; the
CPU's when the benchmark names no other) and, from ``report``, ``"targets"`` and ``"notes"`` where metrics carry
them. ``benchmarks/report_readme.py`` writes ``benchmarks/README.md`` from these files.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Metric:
    """One measured value; ``target`` (same unit) is an upper bound shown beside it."""

    key: str
    value: float
    unit: str
    target: float | None = None
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        return "ok" if self.value <= self.target else "OVER"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def table(metrics: Sequence[Metric]) -> str:
    """The metrics as an aligned text table with value, unit, target, value/target and verdict."""
    header = ("metric", "value", "unit", "target", "x target", "", "note")
    lines = [header]
    for m in metrics:
        ratio = "-" if m.target is None else f"{m.value / m.target:.2f}"
        lines.append((m.key, _number(m.value), m.unit, _number(m.target), ratio, m.verdict, m.note))
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    right = {1, 3, 4}
    out = []
    for line in lines:
        cells = [cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def write_json(
    name: str,
    metrics: dict[str, float],
    units: dict[str, str],
    *,
    results_dir: Path = RESULTS,
    machine: dict[str, object] | None = None,
    targets: dict[str, float] | None = None,
    notes: dict[str, str] | None = None,
    command: str | None = None,
) -> Path:
    """Writes ``<results_dir>/<name>.json`` in the shared shape; returns the path written.

    ``command`` is the run the rows came from, when that is not this process's (rows merged from a
    partial rerun keep their full run's command; the rerun's rows say theirs in ``notes``)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    payload: dict[str, object] = {
        "benchmark": name,
        "metrics": metrics,
        "units": units,
        "command": command or command_line(),
    }
    payload["machine"] = cpu_machine() if machine is None else machine
    if targets:
        payload["targets"] = targets
    if notes:
        payload["notes"] = notes
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return path


def command_line() -> str:
    """The command that is running, as a reader would type it from the repository root."""
    script = Path(sys.argv[0])
    if script.suffix == ".py" and script.resolve().parent == RESULTS.parent:
        return shlex.join(["python", f"benchmarks/{script.name}", *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def cpu_machine() -> dict[str, object]:
    """The CPU's capability and bfloat16 facts (``DeviceNumerics.as_dict``), probed once per process."""
    from prefill_shell.backends.numerics import probe_numerics

    return probe_numerics("cpu").as_dict()


def report(
    name: str, metrics: Sequence[Metric], *, results_dir: Path = RESULTS, machine: dict[str, object] | None = None
) -> Path:
    """Prints the table and writes ``<results_dir>/<name>.json``; returns the path written."""
    print(table(metrics))
    values, units = {m.key: m.value for m in metrics}, {m.key: m.unit for m in metrics}
    targets = {m.key: m.target for m in metrics if m.target is not None}
    notes = {m.key: m.note for m in metrics if m.note}
    return write_json(name, values, units, results_dir=results_dir, machine=machine, targets=targets, notes=notes)
