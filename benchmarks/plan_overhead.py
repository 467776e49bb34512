"""Host cost of the pure planning core: plan, prepare, chunk iteration and the warm-up manifest.

Every batch is constructed outside the timed region; each figure is the
median over many timed samples (garbage collection off while timing).
The figures are reported, not judged: a machine's speed drifts 2x from run
to run, so speed is compared against a base commit in alternating rounds
(see the closing notes of the planner work), never against a fixed number
of microseconds. The JSON goes to benchmarks/results/plan_overhead.json.

    python benchmarks/plan_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Metric, report
from prefill_core import (
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    ceil_div,
    manifest_for,
    plan_prefill,
    prepare_prefill,
)

BLOCK = 32
LAYOUT = PageTableLayout(block_size=BLOCK, max_num_blocks_per_seq=131072 // BLOCK, num_blocks=1 << 20)
POLICY = PrefillPolicy(lane_size=128)  # 80 rows need 80 distinct slots
MANIFEST_LAYOUT = PageTableLayout(block_size=BLOCK, max_num_blocks_per_seq=8192 // BLOCK, num_blocks=8192 // BLOCK)


def batch_of(lengths: list[int], cached: int = 0) -> PrefillBatch:
    """Rows with disjoint consecutive blocks and slots 0..n-1."""
    rows, block = [], 0
    for slot, length in enumerate(lengths):
        need = ceil_div(length, BLOCK)
        rows.append(PrefillRow(length, cached, slot, tuple(range(block, block + need))))
        block += need
    return PrefillBatch.from_rows(tuple(rows))


def median_us(cases: dict[str, tuple[Callable[[], object], int]], samples: int) -> dict[str, float]:
    """Median microseconds of one call of each case (``name -> (fn, calls per sample)``).

    Samples are taken round-robin (one sample of every case per round), so
    a burst of load on a shared machine lands on every case alike and the
    ratios between cases stay meaningful.
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn, _ in cases.values():
        fn()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(samples):
            for name, (fn, inner) in cases.items():
                start = time.perf_counter_ns()
                for _ in range(inner):
                    fn()
                times[name].append((time.perf_counter_ns() - start) / inner / 1000)
    finally:
        if enabled:
            gc.enable()
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (finishes in well under a minute)")
    args = parser.parse_args(argv)
    samples = 150 if args.quick else 1500
    slow_samples = 10 if args.quick else 60

    short = {n: batch_of([128] * n) for n in (1, 8, 32, 80)}
    rng = random.Random(20240611)
    mixed = batch_of([rng.randint(20, 1000) for _ in range(32)])
    long_row = batch_of([131072], cached=2048)
    # The same row with a scattered page table: 4096 distinct ids in random
    # order (a long-running pool), and in runs of 16-64 consecutive ids in
    # random order (what a paged allocator's free list tends to hand out).
    shuffled_ids = rng.sample(range(LAYOUT.num_blocks), 4096)
    runs, start = [], 0
    while start < 4096:
        size = min(rng.randint(16, 64), 4096 - start)
        runs.append(range(start * 2, start * 2 + size))  # gaps between runs
        start += size
    rng.shuffle(runs)
    long_shuffled = PrefillBatch.from_rows([PrefillRow(131072, 2048, 0, tuple(shuffled_ids))])
    long_runs = PrefillBatch.from_rows([PrefillRow(131072, 2048, 0, tuple(b for run in runs for b in run))])

    def plan(batch):
        return lambda: plan_prefill(batch, POLICY, LAYOUT)

    def plan_and_iterate():
        for request in plan_prefill(long_row, POLICY, LAYOUT):
            for _chunk in request.chunks:
                pass

    def plan_iterate_and_materialize():
        for request in plan_prefill(long_row, POLICY, LAYOUT):
            for chunk in request.chunks:
                request.fill_table_of(chunk)
            request.read_table_values()

    fast = median_us(
        {
            **{f"plan_{n}x128": (plan(batch), 4) for n, batch in short.items()},
            "plan_mixed": (plan(mixed), 4),
            "plan_long": (plan(long_row), 2),
            "plan_long_shuffled": (plan(long_shuffled), 2),
            "plan_long_runs": (plan(long_runs), 2),
            "prepare_32": (lambda: prepare_prefill(short[32], POLICY, LAYOUT), 4),
            "iterate_long": (plan_and_iterate, 1),
            "materialize_long": (plan_iterate_and_materialize, 1),
            "reference": (lambda: sum(range(10_000)), 1),
        },
        samples,
    )
    # The same long-row plan called back to back (20 calls per sample), so its
    # block ids stay in cache: the gap to plan_long is what the round-robin
    # samples above pay for starting cold.
    warm_long = median_us({"w": (plan(long_row), 20)}, slow_samples)["w"]
    manifest = manifest_for(PrefillPolicy(), MANIFEST_LAYOUT)
    manifest_ms = (
        median_us({"m": (lambda: manifest_for(PrefillPolicy(), MANIFEST_LAYOUT), 1)}, slow_samples)["m"] / 1000
    )
    per_row = {n: fast[f"plan_{n}x128"] for n in short}
    plan_mixed, plan_long, prepare_32 = fast["plan_mixed"], fast["plan_long"], fast["prepare_32"]
    iterate_long, materialize_long = fast["iterate_long"], fast["materialize_long"]

    (long_request,) = plan_prefill(long_row, POLICY, LAYOUT)
    one = per_row[1]
    metrics = [
        *(
            Metric(f"plan_{n}x128_us", per_row[n], "us", None, f"{per_row[n] / one:.2f}x the 1-row plan")
            for n in (1, 8, 32, 80)
        ),
        Metric("plan_32_mixed_20_1000_us", plan_mixed, "us", None, f"{plan_mixed / per_row[32]:.2f}x 32x128"),
        Metric(
            "plan_131072_row_cached_2048_us",
            plan_long,
            "us",
            None,
            f"{long_request.num_chunks} chunks of 2048, 4096 blocks",
        ),
        Metric(
            "plan_131072_row_back_to_back_us",
            warm_long,
            "us",
            None,
            "same row, 20 calls in a row per sample (warm caches)",
        ),
        Metric(
            "plan_131072_row_shuffled_blocks_us",
            fast["plan_long_shuffled"],
            "us",
            None,
            "same row, 4096 ids in random order",
        ),
        Metric(
            "plan_131072_row_block_runs_us",
            fast["plan_long_runs"],
            "us",
            None,
            "same row, runs of 16-64 ids in random order",
        ),
        Metric("prepare_32x128_us", prepare_32, "us", None, "plan + sampling path + identities"),
        Metric("prepare_over_plan_32x128", prepare_32 / per_row[32], "ratio"),
        Metric(
            "plan_131072_and_iterate_chunks_us", iterate_long, "us", None, f"{iterate_long / plan_long:.2f}x plan alone"
        ),
        Metric(
            "plan_131072_chunks_and_tables_us",
            materialize_long,
            "us",
            None,
            "also materializes every fill table and the read table",
        ),
        Metric("manifest_default_8192_ms", manifest_ms, "ms", None, "default policy, block 32"),
        Metric("manifest_default_8192_programs", len(manifest.program_signatures), "count"),
        Metric("manifest_default_8192_traces", len(manifest.trace_signatures), "count"),
        Metric("machine_reference_sum_range_10000_us", fast["reference"], "us", None, "CPython speed of this machine"),
    ]
    report("plan_overhead", metrics)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
