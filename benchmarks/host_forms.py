"""Forms the code chose for speed, each measured beside the plain form it replaced.

    python benchmarks/host_forms.py [--quick]

Each row times the chosen form and the plain alternative, interleaved in one
run (the machine is shared and drifts), and reports both medians and the
ratio plain/chosen. A ratio near 1 means the choice no longer pays and the
plain form should come back.

* ``int_vector``: the per-step start, slots and last-token vectors (32 ints)
  as ``torch.frombuffer`` over a C array (``inputs._int_vector``) vs
  ``torch.tensor`` on the list.
* ``inference_mode``: entering ``torch.inference_mode`` once per invocation
  (``PrefillRuntime.invoke``) vs once per model call (body and LM head).
* ``result_record``: a 32-row wave's sampled results built with
  ``assembler.result_record`` (``tuple.__new__`` on all five fields) vs
  ``PrefillResult(row, token=..., logprob=...)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Metric, report  # noqa: E402
from prefill_shell.assembler import result_record  # noqa: E402
from prefill_shell.inputs import _int_vector  # noqa: E402
from prefill_shell.result import PrefillResult  # noqa: E402

VALUES = list(range(32))
LOGPROBS = [-0.5] * 32


def _plain_vector() -> None:
    torch.tensor(VALUES, dtype=torch.int64)


def _chosen_vector() -> None:
    _int_vector(VALUES, torch.int64)


def _mode_per_call() -> None:
    for _ in range(2):  # the body and the LM head
        with torch.inference_mode():
            pass


def _mode_per_invocation() -> None:
    with torch.inference_mode():
        pass


def _plain_records() -> None:
    [PrefillResult(row, token=token, logprob=lp) for row, token, lp in zip(VALUES, VALUES, LOGPROBS)]


def _chosen_records() -> None:
    [result_record((row, None, token, lp, ())) for row, token, lp in zip(VALUES, VALUES, LOGPROBS)]


CASES = {
    "int_vector": (_chosen_vector, _plain_vector),
    "inference_mode": (_mode_per_invocation, _mode_per_call),
    "result_record": (_chosen_records, _plain_records),
}


def _mean_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def run(rounds: int, calls: int) -> list[Metric]:
    samples = {name: ([], []) for name in CASES}
    for r in range(rounds):
        for name, (chosen, plain) in CASES.items():
            pair = (chosen, plain) if r % 2 == 0 else (plain, chosen)
            times = [_mean_us(fn, calls) for fn in pair]
            chosen_us, plain_us = times if r % 2 == 0 else times[::-1]
            samples[name][0].append(chosen_us)
            samples[name][1].append(plain_us)
    metrics = []
    for name, (chosen, plain) in samples.items():
        c, p = statistics.median(chosen), statistics.median(plain)
        metrics += [Metric(f"{name}.chosen_us", c, "us"), Metric(f"{name}.plain_us", p, "us"),
                    Metric(f"{name}.plain_over_chosen", p / c, "x", note=f"{rounds} interleaved rounds")]
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    report("host_forms", run(rounds=5 if ns.quick else 21, calls=200 if ns.quick else 2000))


if __name__ == "__main__":
    main()
