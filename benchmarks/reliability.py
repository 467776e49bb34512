"""Reliability figures: fault sweeps and property/example counts.

Runs every fault point of every scenario in ``prefill_shell.testing.sweep``
(the same sweep ``tests/robustness/test_reliability.py`` asserts on) and prints
fault points, leaks and KV bytes changed outside the call's written blocks
(cached-prefix blocks are read-only) per scenario and per fault type
(``InjectedFault`` and ``KeyboardInterrupt``), plus the hypothesis
example budget of each profile.

    python benchmarks/reliability.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks._report import write_json
from prefill_shell.reference import random_llama
from prefill_shell.testing.sweep import FAULT_TYPES, SCENARIOS, sweep


def main() -> None:
    import conftest  # the hypothesis profiles

    model = random_llama(0, "tiny")
    metrics, units = {}, {}
    header = (
        f"{'scenario':<22} {'raises':<17} {'fault points':>12} {'raised':>6} {'unchanged':>9} {'orphaned':>8} "
        f"{'noted':>5} {'leaks':>5} {'KV bytes changed outside writes':>31} {'wrong after':>11}"
    )
    print(header)
    for scenario in SCENARIOS:
        for raises in FAULT_TYPES:
            r = sweep(model, scenario, raises=raises)
            print(
                f"{r.scenario:<22} {r.raises:<17} {r.fault_points:>12} {r.faults_raised:>6} {r.errors_unchanged:>9} "
                f"{r.release_faults_kept_as_orphans:>8} {r.runs_with_cleanup_notes:>5} {r.leaked_tensors:>5} "
                f"{r.kv_bytes_corrupted:>31} {r.wrong_results_after_fault:>11}"
            )
            for field in (
                "fault_points",
                "faults_raised",
                "errors_unchanged",
                "release_faults_kept_as_orphans",
                "leaked_tensors",
                "kv_bytes_corrupted",
                "wrong_results_after_fault",
            ):
                key = f"{scenario.name}.{r.raises}.{field}"
                metrics[key], units[key] = getattr(r, field), "count"
    metrics["hypothesis_examples_ci"] = conftest.CI_EXAMPLES
    metrics["hypothesis_examples_fuzz"] = conftest.FUZZ_EXAMPLES
    units.update(hypothesis_examples_ci="examples per property", hypothesis_examples_fuzz="examples per property")
    print(f"hypothesis examples per property: ci {conftest.CI_EXAMPLES}, fuzz {conftest.FUZZ_EXAMPLES}")
    write_json("reliability", metrics, units)


if __name__ == "__main__":
    main()
