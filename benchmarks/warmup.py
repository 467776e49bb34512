"""Start-up on the CPU: what a ServingFacade's warm-up costs on SmolLM2, and whether it bought anything.

Rows (``python benchmarks/warmup.py [--quick]``; needs the SmolLM2 GGUF, ``scripts/ensure-model.sh``):

1. ``compile_only_s``: ``warmup_model_prefill(enable_trace=False)`` of a
   ``ServingFacade`` at ``max_seq_len=8192, max_batch_size=32`` with the
   backend's own policy (fine rungs on the CPU), target 10 s. The CPU builds
   nothing per shape, so the phase runs one smallest body (the process's
   one-time start-up); the note is its stated cost (stage ``"cost"``).
2. ``first_over_warm.<shape>``: after that warm-up, the first eager call of
   a shape against warm calls of the same shape, target 1.0 (no slower).
   Rounds interleave the shapes; in round ``k`` each shape's rows are ``k``
   tokens longer than its base, a shape this process has never run, so every
   round has a genuine first call (round 0's are the first calls of any
   shape after the warm-up). Each (round, shape) is timed as first call, then
   two warm calls; its ratio is the first over their median (one sample
   against the typical one, not the luckiest). Times are the process's CPU
   seconds (``time.process_time``, ``--threads`` torch threads, default 1):
   on a shared machine a call's wall time mostly measures
   preemption (oneDNN's verbose log showed one GEMM taking 2 to 15 ms within
   one call). The row is the median CPU ratio over rounds, its note the
   spread (min-max), round 0's ratio and the same figures in wall time;
   ``first_over_warm.all`` is the median over every pair.
3. ``limited_traced``: ``warmup_lengths=(128, 1024)``; the traced phase
   captures only bodies of those lengths (``captured_other_lengths``, target 0)
   and its stated persistent bytes over the ledger's measured trace and
   workspace bytes (``predicted_over_measured_bytes``, within 10%).
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
from prefill_shell.backends import TorchBackend
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.progress import Progress
from prefill_shell.reference.loading.gguf import load_gguf
from prefill_shell.reference.loading.smollm2 import smollm2_path
from prefill_shell.serving.facade import ServingFacade

MAX_SEQ_LEN, MAX_BATCH = 8192, 32
SHAPES = {"1x100": [100], "1x700": [700], "8x60": [60] * 8, "1x2000": [2000]}
QUICK_SHAPES = {"1x100": [100], "4x60": [60] * 4}
ROUNDS, QUICK_ROUNDS = 5, 3
LIMITED = (128, 1024)


def _call(facade: ServingFacade, lengths: list[int], seed: int, enable_trace: bool = False) -> float:
    """Seconds of one prefill_forward of rows of ``lengths`` over disjoint blocks of the provisional pool."""
    return _timed_call(facade, lengths, seed, enable_trace)[0]


def _timed_call(facade: ServingFacade, lengths: list[int], seed: int, enable_trace: bool = False):
    """``(wall seconds, this process's CPU seconds)`` of one such call."""
    block = facade.runtime.config.layout.block_size
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for n in lengths)
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    table = torch.full((len(lengths), width), -1, dtype=torch.int32)
    next_block = 0
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.randint(1, facade.model.spec.vocab_size, (n,), generator=gen)
        blocks = -(-n // block)
        table[row, :blocks] = torch.arange(next_block, next_block + blocks, dtype=torch.int32)
        next_block += blocks
    start, cpu = time.perf_counter(), time.process_time()
    facade.prefill_forward(tokens, table, enable_trace=enable_trace, prompt_lens=lengths, kv_cache=facade.kv)
    return time.perf_counter() - start, time.process_time() - cpu


def _first_over_warm(facade: ServingFacade, shapes: dict, rounds: int) -> list[Metric]:
    """First-call over warm-call ratios of every shape, rounds interleaved (see module doc, row 2)."""
    cpu: dict[str, list[float]] = {name: [] for name in shapes}
    wall: dict[str, list[float]] = {name: [] for name in shapes}
    seed = 1
    for k in range(rounds):
        for name, base in shapes.items():
            lengths = [n + k for n in base]  # never run before in this process
            first = _timed_call(facade, lengths, seed)
            warm = [_timed_call(facade, lengths, seed + 1), _timed_call(facade, lengths, seed + 2)]
            seed += 3
            cpu[name].append(first[1] / statistics.median(w[1] for w in warm))
            wall[name].append(first[0] / statistics.median(w[0] for w in warm))
            shown = ", ".join(f"{w:.3f}/{c:.3f}" for w, c in [first, *warm])
            print(f"round {k} {name} (wall/CPU s, first then warm): {shown}; CPU ratio {cpu[name][-1]:.3f}")
    rows = []
    for name in shapes:
        note = (
            f"CPU: {_spread(cpu[name])}, round 0 {cpu[name][0]:.2f}; "
            f"wall: median {statistics.median(wall[name]):.2f}, {_spread(wall[name])}"
        )
        rows.append(Metric(f"first_over_warm.{name}", statistics.median(cpu[name]), "ratio", 1.0, note))
    every = [r for values in cpu.values() for r in values]
    walls = [r for values in wall.values() for r in values]
    note = (
        f"CPU: {_spread(every)} over {len(every)} pairs; wall: median {statistics.median(walls):.2f}, {_spread(walls)}"
    )
    rows.append(Metric("first_over_warm.all", statistics.median(every), "ratio", 1.0, note))
    return rows


def _spread(values: list[float]) -> str:
    return f"spread {min(values):.2f}-{max(values):.2f}"


def _compile_only(model, shapes: dict, rounds: int) -> list[Metric]:
    facade = ServingFacade(model, TorchBackend(), max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH)
    facade.allocate_kv_cache()
    events: list[Progress] = []
    start = time.perf_counter()
    facade.warmup_model_prefill(
        kv_cache=facade.kv, can_sample_on_device=True, enable_trace=False, on_progress=events.append
    )
    seconds = time.perf_counter() - start
    cost = events[0].detail
    print(f"compile-only warm-up cost as stated: {cost}")
    rows = [Metric("compile_only_s", seconds, "s", 10.0, cost.split(",")[0])]
    rows += _first_over_warm(facade, shapes, rounds)
    facade.executor.close()
    return rows


def _limited_traced(model) -> list[Metric]:
    facade = ServingFacade(
        model, TorchBackend(), max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH, warmup_lengths=LIMITED
    )
    facade.allocate_kv_cache()
    events: list[Progress] = []
    start = time.perf_counter()
    for enable_trace in (False, True):
        facade.warmup_model_prefill(
            kv_cache=facade.kv, can_sample_on_device=False, enable_trace=enable_trace, on_progress=events.append
        )
    seconds = time.perf_counter() - start
    executor = facade.executor
    manifest_cost = [e.detail for e in events if e.stage == "cost"][-1]
    predicted = int(manifest_cost.rsplit(", ", 1)[1].split()[0])
    live = facade.runtime.backend.ledger.live([Ownership.TRACE, Ownership.WORKSPACE])
    measured = sum(handle.value.nbytes for handle in live)
    lengths = {trace.signature.chunk_length for trace in facade.runtime.captured_traces()}
    print(f"limited traced warm-up cost as stated: {manifest_cost}; captured lengths {sorted(lengths)}")
    executor.close()
    return [
        Metric("limited_traced_s", seconds, "s", None, f"lengths {LIMITED}"),
        Metric("captured_other_lengths", float(len(lengths - set(LIMITED))), "count", None, "must be 0"),
        Metric("predicted_over_measured_bytes", predicted / measured, "ratio", 1.1, f"measured {measured} B"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small shapes only")
    parser.add_argument("--compile-only", action="store_true", help="rows 1 and 2 only (row 3 takes minutes)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_gguf(smollm2_path(), dtype=torch.float32)
    rows = _compile_only(model, QUICK_SHAPES if args.quick else SHAPES, QUICK_ROUNDS if args.quick else ROUNDS)
    if args.compile_only:
        report("warmup_compile_only", rows)
        return
    rows += _limited_traced(model)
    report("warmup", rows)
    values = {row.key: row.value for row in rows}
    if values["captured_other_lengths"] or abs(values["predicted_over_measured_bytes"] - 1) > 0.1:
        raise SystemExit("a limited warm-up captured other lengths, or its bytes were mispredicted by over 10%")


if __name__ == "__main__":
    main()
