"""Forms the code chose for speed, each measured beside the plain form it replaced.

    python benchmarks/host_forms.py [--quick] [--threads N]

Two torch threads by default, as ``prefill_throughput.py`` runs the model.

Each row times the chosen form and the plain alternative, interleaved in one
run (the machine is shared and drifts), and reports both medians and the
ratio plain/chosen. A ratio near 1 means the choice no longer pays and the
plain form should come back.

* ``inference_mode``: entering ``torch.inference_mode`` once per invocation
  (``PrefillRuntime.invoke``) vs once per model call (body and LM head).
* ``lm_head_{1,8,32}rows``: the reference model's LM head at the bench
  model's 32000 x 512 head, a ``Projection`` (weight prepacked for oneDNN
  on the CPU, ``prefill_shell/reference/projection.py``) vs ``F.linear``.
* ``qkv_{128,1024}rows`` / ``swiglu_mlp_{128,1024}rows``: the same choice in
  the model body at SmolLM2-135M's shapes (576 wide, fused QKV 960 rows,
  MLP 1536): the QKV projection, and the whole SwiGLU MLP with its residual
  add (prepacked, activation and add fused into the GEMM calls, vs
  ``F.linear``, ``F.silu``, ``mul`` and ``addmm``).
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
from prefill_shell.reference.projection import Projection


def _mode_per_call() -> None:
    for _ in range(2):  # the body and the LM head
        with torch.inference_mode():
            pass


def _mode_per_invocation() -> None:
    with torch.inference_mode():
        pass


_GEN = torch.Generator().manual_seed(0)
HIDDEN, QKV, INTERMEDIATE = 576, 960, 1536  # SmolLM2-135M


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_GEN)


def _head_case(rows: int) -> tuple:
    head, x = _randn(32000, 512), _randn(rows, 512)
    projection = Projection(head)
    return (lambda: projection(x)), (lambda: F.linear(x, head))


def _qkv_case(rows: int) -> tuple:
    weight, x = _randn(QKV, HIDDEN), _randn(rows, HIDDEN)
    projection = Projection(weight)
    return (lambda: projection(x)), (lambda: F.linear(x, weight))


def _mlp_case(rows: int) -> tuple:
    gate, up, down = _randn(INTERMEDIATE, HIDDEN), _randn(INTERMEDIATE, HIDDEN), _randn(HIDDEN, INTERMEDIATE)
    x, residual = _randn(rows, HIDDEN), _randn(rows, HIDDEN)
    g, u, d = Projection(gate), Projection(up), Projection(down)

    def chosen():
        return d.plus(u.times(x, g.silu(x)), residual)

    def plain():
        return torch.addmm(residual, F.silu(F.linear(x, gate)).mul_(F.linear(x, up)), down.t())

    return chosen, plain


CASES = {
    "inference_mode": (_mode_per_invocation, _mode_per_call),
    **{f"lm_head_{n}rows": _head_case(n) for n in (1, 8, 32)},
    **{f"qkv_{n}rows": _qkv_case(n) for n in (128, 1024)},
    **{f"swiglu_mlp_{n}rows": _mlp_case(n) for n in (128, 1024)},
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
            n = calls if name == "inference_mode" else max(1, calls // 200)  # a GEMM takes milliseconds
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
    parser.add_argument("--threads", type=int, default=2)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    report("host_forms", run(rounds=5 if ns.quick else 21, calls=200 if ns.quick else 2000))


if __name__ == "__main__":
    main()
