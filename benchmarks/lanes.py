"""Rows per second of one lane vs a 2-lane ``LaneGroup`` on this CPU, side by side in one run.

The same call (``--rows`` prompts of ``--length`` tokens, the "demo" Llama,
logits only) is served five ways, interleaved round by round (the order
rotates each round) so machine load hits every case alike; medians are
reported:

* ``1 lane x 2 threads``: one runtime holding every row, two intra-op torch threads;
* ``2 lanes on threads x 1``: a ``LaneGroup`` of two runtimes, each lane on a
  Python thread of its own, one intra-op torch thread (the group's CPU default);
* ``2 lanes in turn x 2``: the same group run lane after lane, two torch threads;
* ``1 lane x 1 thread`` and ``2 lanes in turn x 1``: the references that say
  where the time goes (parallel lanes, or no intra-op threads at all).

Each case also reports CPU seconds per wall second of the process (about 2
when both cores compute; more wall than CPU means waiting). Ratios are the
median of per-round ratios (both sides of a ratio ran in the same round). The decision
this benchmark makes for ``LaneGroup``: lanes on CPU torch backends run on
threads of their own when ``2 lanes on threads x 1`` beats ``2 lanes in
turn x 2`` (the ratio row), else in turn.

    python benchmarks/lanes.py [--rounds N] [--rows R] [--length L] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Metric, report
from prefill_core import PageTableLayout, PrefillPolicy
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.lanes.group import LaneGroup
from prefill_shell.reference import random_llama

BLOCK = 32


def _runtime(model, lane_size: int, num_blocks: int) -> PrefillRuntime:
    policy = PrefillPolicy(lane_size=lane_size, length_ladder=(128, 256), max_chunk_length=256, chunk_quantum=256)
    layout = PageTableLayout(BLOCK, 8, num_blocks)
    kv = model.new_kv_cache(num_blocks, BLOCK)
    return PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend("cpu"), kv, layout, policy))


def _cases(model, rows: int, length: int) -> dict:
    """Case name -> (torch threads, a function serving the call once)."""
    per_row = -(-length // BLOCK)
    tokens = torch.randint(1, model.spec.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    table = torch.arange(rows * per_row, dtype=torch.int32).reshape(rows, per_row)
    one = _runtime(model, rows, rows * per_row)
    half = -(-rows // 2)
    group_lanes = [PrefillExecutor(_runtime(model, half, rows * per_row)) for _ in range(2)]
    threaded, in_turn = LaneGroup(group_lanes, threaded=True), LaneGroup(group_lanes, threaded=False)
    slots = list(range(rows))  # rows 0..half-1 to lane 0, the rest to lane 1
    lengths = [length] * rows

    def single():
        one.prefill(tokens, table, lengths, slots=slots)

    def on_threads():
        threaded.prefill(tokens, table, lengths, slots=slots)

    def one_after_another():
        in_turn.prefill(tokens, table, lengths, slots=slots)

    return {
        "1 lane x 2 threads": (2, single),
        "2 lanes on threads x 1": (1, on_threads),
        "2 lanes in turn x 2": (2, one_after_another),
        "1 lane x 1 thread": (1, single),
        "2 lanes in turn x 1": (1, one_after_another),
    }


def _measure(cases: dict, rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per case, wall seconds and process CPU seconds of each round (case order rotates every round)."""
    names = list(cases)
    times = {name: ([], []) for name in names}
    for threads, run in cases.values():  # one untimed pass each: first-touch allocations, lazy inits
        torch.set_num_threads(threads)
        run()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            threads, run = cases[name]
            torch.set_num_threads(threads)
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            times[name][0].append(time.perf_counter() - wall)
            times[name][1].append(time.process_time() - cpu)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    threads_before = torch.get_num_threads()
    load = os.getloadavg()[0]
    model = random_llama(0, "demo")
    times = _measure(_cases(model, args.rows, args.length), rounds)
    torch.set_num_threads(threads_before)
    metrics = []
    for name, (wall, cpu) in times.items():
        median = statistics.median(wall)
        busy = statistics.median(c / w for c, w in zip(cpu, wall))
        note = f"median of {rounds}; {median * 1e3:.0f} ms per call; {busy:.2f} CPU s per wall s"
        metrics.append(Metric(f"rows/s, {name}", args.rows / median, "rows/s", note=note))
    for top, bottom in (
        ("2 lanes on threads x 1", "1 lane x 2 threads"),
        ("2 lanes on threads x 1", "2 lanes in turn x 2"),
        ("2 lanes on threads x 1", "2 lanes in turn x 1"),
        ("1 lane x 1 thread", "1 lane x 2 threads"),
    ):
        per_round = [slow / fast for fast, slow in zip(times[top][0], times[bottom][0])]  # wall time ratios
        note = f"rows/s over rows/s, median of per-round ratios (range {min(per_round):.2f}-{max(per_round):.2f})"
        metrics.append(Metric(f"ratio, {top} / {bottom}", statistics.median(per_round), "x", note=note))
    print(f"{args.rows} rows x {args.length} tokens, demo Llama, {os.cpu_count()} CPUs, load average {load:.1f}")
    report("lanes", metrics)


if __name__ == "__main__":
    main()
