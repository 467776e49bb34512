"""Host staging cost: the ttnn backend's host tensors vs the torch backend's upload, per step.

Cases (each one ``HostStep`` built by the runtime's own planner and stager):

* ``wave32x128``: a regular wave of 32 rows of 128 tokens;
* ``chunk2048``: one 2048-token chunk of a 4096-token row with 2048 cached
  (tokens, start, slots, fill table, read table, last index);
* ``slots32``: one int32 ``[32]`` vector alone: the per-tensor floor.

``ttnn`` is ``ttnn_staging.stage`` of every field, one spec at a time: each
a real ttnn host tensor in the device contract (uint32 tokens, int32 tables and vectors),
everything ``TtnnBackend.upload`` does before ``ttnn.to_device``. ``torch``
is ``TorchBackend.upload`` of the same fields on CPU (a copy each, plus the
ledger entry). Measurements alternate, and which goes first flips every
repeat; medians in microseconds. Target: ttnn staging within 2x of torch.

    python benchmarks/staging.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Metric, report
from prefill_core import PageTableLayout, PrefillBatch, PrefillPolicy, PrefillRow, ceil_div, plan_prefill
from prefill_shell.backends import TorchBackend
from prefill_shell.device.contract import SLOTS
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.steps.inputs import build_host_steps

BLOCK = 64
LAYOUT = PageTableLayout(BLOCK, 4096 // BLOCK, 192)
MAX_RATIO = 2.0

# (name, prompt lengths, cached lengths): whole steps, held to the 2x target
CASES = (
    ("wave32x128", [128] * 32, [0] * 32),
    ("chunk2048", [4096], [2048]),
)


STEP_CASES = tuple(name for name, _, _ in CASES)


def host_step(lengths: list[int], cached: list[int]):
    """The single step of the first request the planner makes for these rows."""
    rows, first = [], 0
    for slot, (length, done) in enumerate(zip(lengths, cached)):
        need = ceil_div(length, BLOCK)
        rows.append(PrefillRow(length, done, slot, tuple(range(first, first + need))))
        first += need
    (request,) = plan_prefill(PrefillBatch.from_rows(tuple(rows)), PrefillPolicy(), LAYOUT)
    tokens = torch.randint(1, 32000, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(0))
    steps = build_host_steps(tokens, request)
    return steps[-1]


def _timed_us(stage, step) -> float:
    start = time.perf_counter()
    staged = stage(step)
    elapsed = (time.perf_counter() - start) * 1e6
    del staged  # freed outside the timed region for both backends
    return elapsed


def _torch_stager(backend: TorchBackend, only=None):
    def stage(step) -> list:
        return [
            backend.upload(host, spec, Ownership.INVOCATION)
            for spec, host in step.items()
            if only is None or spec is only
        ]

    return stage


def _ttnn_step_stager(ttnn_staging):
    """Every field of a step, staged per spec as ``TtnnBackend.upload`` stages each."""
    return lambda step: {spec: ttnn_staging.stage(spec, host) for spec, host in step.items()}


def _ttnn_slots_stager(ttnn_staging):
    """The per-tensor floor: one int32 [B] vector (no range check), as staged in every step."""
    return lambda step: ttnn_staging.stage_int_vector(step[SLOTS], name="slots")


def run(repeats: int) -> dict[str, dict[str, float]]:
    from prefill_shell.tt import staging as ttnn_staging  # imports ttnn (a few seconds)

    backend = TorchBackend("cpu")
    steps = {name: host_step(lengths, cached) for name, lengths, cached in CASES}
    cases = {name: (_ttnn_step_stager(ttnn_staging), _torch_stager(backend)) for name in steps}
    cases["slots32"] = (_ttnn_slots_stager(ttnn_staging), _torch_stager(backend, SLOTS))
    steps["slots32"] = steps["wave32x128"]
    out = {}
    for name, (ttnn_stage, torch_stage) in cases.items():
        step, times = steps[name], {"ttnn": [], "torch": []}
        stagers = {"ttnn": ttnn_stage, "torch": torch_stage}
        for _ in range(20):  # first-call costs (allocator, ttnn type caches) are not staging
            _release(backend), _timed_us(ttnn_stage, step), _timed_us(torch_stage, step)
        for i in range(repeats):
            for which in ("ttnn", "torch") if i % 2 == 0 else ("torch", "ttnn"):
                times[which].append(_timed_us(stagers[which], step))
            _release(backend)
        ttnn_us, torch_us = statistics.median(times["ttnn"]), statistics.median(times["torch"])
        out[name] = {"ttnn_us": ttnn_us, "torch_us": torch_us, "ratio": ttnn_us / torch_us, "repeats": repeats}
    return out


def _release(backend: TorchBackend) -> None:
    for handle in backend.ledger.live():
        backend.release(handle)


def _metrics(rows: dict[str, dict[str, float]]) -> list:
    """Per case: ttnn and torch medians, their ratio (target 2x for whole steps) and the repeat count."""
    out = []
    for case, row in rows.items():
        target = MAX_RATIO if case in STEP_CASES else None
        out += [
            Metric(f"{case}.ttnn_us", row["ttnn_us"], "us", note="ttnn_staging host tensors"),
            Metric(f"{case}.torch_us", row["torch_us"], "us", note="TorchBackend.upload on CPU"),
            Metric(f"{case}.ratio", row["ratio"], "x", target, "ttnn / torch"),
            Metric(f"{case}.repeats", row["repeats"], "count"),
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats: well under a minute")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per backend and case")
    args = parser.parse_args()
    rows = run(args.repeats or (200 if args.quick else 2000))
    print("staging: host microseconds per step (medians, interleaved)")
    report("staging", _metrics(rows))


if __name__ == "__main__":
    main()
