"""The README's reliability figures: fault sweeps and property/example counts.

Runs every fault point of every scenario in ``prefill_shell.testing.sweep``
(the same sweep ``tests/shell/test_reliability.py`` asserts on) and prints
fault points, leaks and KV bytes corrupted per scenario, plus the hypothesis
example budget of each profile.

    python benchmarks/reliability.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks._report import write_json  # noqa: E402
from prefill_shell.reference import random_llama  # noqa: E402
from prefill_shell.testing.sweep import SCENARIOS, sweep  # noqa: E402



def main() -> None:
    import conftest  # the hypothesis profiles  # noqa: PLC0415

    model = random_llama(0, "tiny")
    metrics, units = {}, {}
    header = f"{'scenario':<22} {'fault points':>12} {'raised':>6} {'unchanged':>9} {'orphaned':>8} {'noted':>5} {'leaks':>5} {'KV bytes corrupted':>18} {'wrong after':>11}"
    print(header)
    for scenario in SCENARIOS:
        r = sweep(model, scenario)
        print(f"{r.scenario:<22} {r.fault_points:>12} {r.faults_raised:>6} {r.errors_unchanged:>9} "
              f"{r.release_faults_kept_as_orphans:>8} {r.runs_with_cleanup_notes:>5} {r.leaked_tensors:>5} "
              f"{r.kv_bytes_corrupted:>18} {r.wrong_results_after_fault:>11}")
        for field in ("fault_points", "faults_raised", "errors_unchanged", "release_faults_kept_as_orphans",
                      "leaked_tensors", "kv_bytes_corrupted", "wrong_results_after_fault"):
            metrics[f"{scenario.name}.{field}"] = getattr(r, field)
            units[f"{scenario.name}.{field}"] = "count"
    metrics["hypothesis_examples_ci"] = conftest.CI_EXAMPLES
    metrics["hypothesis_examples_fuzz"] = conftest.FUZZ_EXAMPLES
    units.update(hypothesis_examples_ci="examples per property", hypothesis_examples_fuzz="examples per property")
    print(f"hypothesis examples per property: ci {conftest.CI_EXAMPLES}, fuzz {conftest.FUZZ_EXAMPLES}")
    write_json("reliability", metrics, units)


if __name__ == "__main__":
    main()
