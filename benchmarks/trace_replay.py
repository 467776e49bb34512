"""Eager vs traced prefill latency per invocation, on the reference "bench" Llama.

Cases (greedy sampling, so each invocation ends in argmax + the token's
log-prob on the device):

* ``1x128``: one 128-token row;
* ``32x128``: a wave of 32 rows of 128 tokens;
* ``chunk2048@4096``: a 4096-token row with 2048 tokens cached, so one
  2048-token chunk reads a 4096-token context.

Each case is prepared once and warmed (compile + capture) before timing; a
measurement is one invocation plus its streaming readback (prepare excluded).
Eager and traced measurements alternate inside one run, and which goes first
flips every repeat, so machine noise hits both alike; medians are reported
with the traced/eager latency ratio.

Targets: on CPU a replay re-runs the captured body, so traced may cost at
most 1.10x eager; on CUDA (``--device cuda``, CUDA graphs) traced 1x128
must be at least 2x faster than eager.

    python benchmarks/trace_replay.py [--quick] [--repeats N] [--device cpu|cuda] [--threads N]

On a shared machine, ``--threads 1`` keeps other processes' load from
inflating one side's medians (intra-op threads spin-wait when cores are busy).
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
from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams, WarmupManifest, ceil_div
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference import random_llama

BLOCK = 64
LAYOUT = PageTableLayout(BLOCK, 4096 // BLOCK, 192)
"""Capacity 4096 tokens; 192 blocks hold the 32-row wave (64 blocks) or the long row (64)."""

CPU_MAX_RATIO = 1.10
CUDA_MIN_SPEEDUP = 2.0

# (name, prompt lengths, cached lengths, repeats per mode: full, quick)
CASES = (
    ("1x128", [128], [0], 40, 15),
    ("32x128", [128] * 32, [0] * 32, 9, 2),
    ("chunk2048@4096", [4096], [2048], 9, 2),
)


def _call(lengths: list[int], cached: list[int], seed: int) -> dict:
    """Seeded tokens and disjoint blocks for one prefill call."""
    gen = torch.Generator().manual_seed(seed)
    need = [ceil_div(n, BLOCK) for n in lengths]
    tokens = torch.randint(1, 32000, (len(lengths), max(lengths)), generator=gen)
    table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
    first = 0
    for row, n in enumerate(need):
        table[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    return {
        "tokens": tokens,
        "page_table": table,
        "prompt_lengths": lengths,
        "cached_lengths": cached,
        "sampling": [SamplingParams.greedy()] * len(lengths),
    }


def _timed_ms(executor: PrefillExecutor, batch, mode: str) -> float:
    runtime = executor.runtime
    if torch.cuda.is_available() and runtime.backend.device.type == "cuda":
        torch.cuda.synchronize(runtime.backend.device)  # nothing queued before the clock starts
    start = time.perf_counter()
    runtime.assemble(executor.invocations(batch, mode), batch.num_rows)  # reads back: synchronizes
    return (time.perf_counter() - start) * 1e3


def run(device: str, quick: bool, repeats: int | None) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    model = random_llama(0, "bench", device=device)
    kv = model.new_kv_cache(LAYOUT.num_blocks, LAYOUT.block_size)
    config = PrefillRuntimeConfig.resolve(model, TorchBackend(device), kv, layout=LAYOUT, policy=PrefillPolicy())
    runtime = PrefillRuntime(config)
    executor = PrefillExecutor(runtime)
    batches = {
        name: runtime.prepare(**_call(lengths, cached, seed=i)) for i, (name, lengths, cached, _, _) in enumerate(CASES)
    }
    manifest = WarmupManifest().observe(p for b in batches.values() for p in b.requests)
    executor.warm_up(manifest)
    out: dict[str, dict[str, float]] = {}
    try:
        for name, _, _, full, fast in CASES:
            batch = batches[name]
            count = repeats or (fast if quick else full)
            if not quick:  # warm-up already ran both paths once; this settles allocator caches
                for mode in ("eager", "traced"):
                    _timed_ms(executor, batch, mode)
            times = {"eager": [], "traced": []}
            for i in range(count):
                order = ("eager", "traced") if i % 2 == 0 else ("traced", "eager")
                for mode in order:
                    times[mode].append(_timed_ms(executor, batch, mode))
            eager, traced = statistics.median(times["eager"]), statistics.median(times["traced"])
            out[name] = {"eager_ms": eager, "traced_ms": traced, "ratio": traced / eager, "repeats": count}
    finally:
        executor.close()
        runtime.close()
    return out


def _metrics(rows: dict[str, dict[str, float]], cuda: bool, threads: int) -> list[tuple]:
    """(key, value, unit, target or None, note) per metric; every target is an upper bound."""
    out: list[tuple] = [("torch_threads", threads, "count", None, "")]
    for case, row in rows.items():
        if not cuda:
            target, note = CPU_MAX_RATIO, "CPU: a replay re-runs the body"
        elif case == "1x128":
            target, note = 1 / CUDA_MIN_SPEEDUP, f"CUDA graph: traced >= {CUDA_MIN_SPEEDUP:.0f}x faster"
        else:
            target, note = None, ""
        out += [
            (f"{case}.eager_ms", row["eager_ms"], "ms", None, f"median of {row['repeats']}"),
            (f"{case}.traced_ms", row["traced_ms"], "ms", None, f"median of {row['repeats']}"),
            (f"{case}.traced_over_eager", row["ratio"], "x", target, note),
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (CUDA graphs)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats: under a minute on CPU")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per mode and case")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    rows = run(args.device, args.quick, args.repeats)
    cuda = args.device.startswith("cuda")
    threads = torch.get_num_threads()
    print(f"trace_replay on {args.device}, {threads} torch threads (bench preset: 4 layers, 512 wide)")
    report("trace_replay_cuda" if cuda else "trace_replay", [Metric(*m) for m in _metrics(rows, cuda, threads)])


if __name__ == "__main__":
    main()
