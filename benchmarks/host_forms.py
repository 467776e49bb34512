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
* ``lm_head_1row`` / ``lm_head_8rows``: the reference model's CPU LM head at
  the bench model's 32000 x 512 head, vocab-major (``vocab_major_head``,
  chosen up to ``VOCAB_MAJOR_MAX_ROWS`` rows) vs ``F.linear``;
  ``lm_head_32rows``: beyond that bound the choice is ``F.linear``, and the
  alternative is vocab-major.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Metric, report
from prefill_shell.assembler import result_record
from prefill_shell.inputs import _int_vector
from prefill_shell.reference.llama import VOCAB_MAJOR_MAX_ROWS, vocab_major_head
from prefill_shell.result import PrefillResult

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
    [result_record((row, None, token, lp, (), ())) for row, token, lp in zip(VALUES, VALUES, LOGPROBS)]


_GEN = torch.Generator().manual_seed(0)
HEAD = torch.randn(32000, 512, generator=_GEN)
HEAD_ROWS = {n: torch.randn(n, 512, generator=_GEN) for n in (1, 8, 32)}


def _head(n: int, vocab_major: bool):
    rows = HEAD_ROWS[n]
    return (lambda: vocab_major_head(HEAD, rows)) if vocab_major else (lambda: F.linear(rows, HEAD))


def _head_case(n: int) -> tuple:
    """(chosen, alternative) for ``n`` rows, as ``PagedLlama.lm_head`` chooses on the CPU."""
    chosen_major = n <= VOCAB_MAJOR_MAX_ROWS
    return _head(n, chosen_major), _head(n, not chosen_major)


CASES = {
    "int_vector": (_chosen_vector, _plain_vector),
    "inference_mode": (_mode_per_invocation, _mode_per_call),
    "result_record": (_chosen_records, _plain_records),
    "lm_head_1row": _head_case(1),
    "lm_head_8rows": _head_case(8),
    "lm_head_32rows": _head_case(32),
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
            n = max(1, calls // 200) if name.startswith("lm_head") else calls  # a head GEMM takes milliseconds
            times = [_mean_us(fn, n) for fn in pair]
            chosen_us, plain_us = times if r % 2 == 0 else times[::-1]
            samples[name][0].append(chosen_us)
            samples[name][1].append(plain_us)
    metrics = []
    for name, (chosen, plain) in samples.items():
        c, p = statistics.median(chosen), statistics.median(plain)
        metrics += [
            Metric(f"{name}.chosen_us", c, "us"),
            Metric(f"{name}.plain_us", p, "us"),
            Metric(f"{name}.plain_over_chosen", p / c, "x", note=f"{rounds} interleaved rounds"),
        ]
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    report("host_forms", run(rounds=5 if ns.quick else 21, calls=200 if ns.quick else 2000))


if __name__ == "__main__":
    main()
