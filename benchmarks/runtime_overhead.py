"""Host time the runtime adds around the model body, per phase, with a null body.

The model here is a null body: ``forward_hidden`` returns a preallocated
hidden tensor and ``lm_head`` preallocated logits, so every microsecond
measured is the runtime's own (planning, staging, ledger, postprocessing,
readback, release). Also times ``PrefillRuntime.prepare`` from caller
tensors to prepared requests with all host step values built.

    python benchmarks/runtime_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import write_json
from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams
from prefill_shell.backends import TorchBackend
from prefill_shell.device.model import ModelSpec
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.runtime import PrefillRuntime

ROWS, LENGTH, HIDDEN, VOCAB, BLOCK = 32, 128, 512, 1024, 32


class NullKV:
    block_size = BLOCK
    num_blocks = ROWS * LENGTH // BLOCK


class NullBody:
    """Implements the model protocol without computing: returns preallocated outputs."""

    def __init__(self):
        self.spec = ModelSpec(VOCAB, HIDDEN, 1, 1, 1, HIDDEN, 8192)
        self.dtype = torch.float32
        self._hidden = torch.zeros(ROWS, LENGTH, HIDDEN)
        self._logits = torch.zeros(ROWS, VOCAB)

    def forward_hidden(self, tokens, start, fill_table, read_table, kv):
        return self._hidden[: tokens.shape[0], : tokens.shape[1]]

    def lm_head(self, rows):
        return self._logits[: rows.shape[0]]


def round_robin_us(cases: dict[str, object], repeats: int, after_round=lambda: None) -> dict[str, float]:
    """Median microseconds of each case's one call, sampled round-robin.

    One sample of every case per round, so a slow spell of this shared
    machine lands on every case alike (and on the CPython reference, which
    shows the machine's state beside the figures). ``after_round`` runs
    untimed between rounds.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    after_round()
    for _ in range(repeats):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
        after_round()
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


def run(repeats: int) -> dict:
    torch.set_num_threads(1)
    layout = PageTableLayout(BLOCK, 64, NullKV.num_blocks)
    runtime = PrefillRuntime(
        PrefillRuntimeConfig.resolve(NullBody(), TorchBackend(), NullKV(), layout, PrefillPolicy())
    )
    tokens = torch.randint(1, VOCAB, (ROWS, LENGTH))
    table = torch.arange(NullKV.num_blocks, dtype=torch.int32).reshape(ROWS, -1)
    lengths = [LENGTH] * ROWS
    greedy = [SamplingParams.greedy()] * ROWS
    cases = {}
    unassembled: list = []  # invoke-only samples: their outputs are released between rounds, untimed

    def release_unassembled():
        for invocation in unassembled:
            runtime.release(invocation.owned)
        unassembled.clear()

    for label, sampling in (("logits", None), ("argmax", greedy)):
        batch = runtime.prepare(tokens, table, lengths, sampling=sampling)
        assert len(batch.requests) == 1 and batch.requests[0].request.padded_batch == ROWS

        def prepare(sampling=sampling):
            runtime.prepare(tokens, table, lengths, sampling=sampling)

        def invoke(batch=batch):
            unassembled.append(runtime.invoke(batch, 0))

        def invoke_and_assemble(batch=batch):
            runtime.assemble(iter([runtime.invoke(batch, 0)]), batch.num_rows)

        cases[f"prepare_32x128.{label}_us"] = prepare
        cases[f"invoke_32_row_wave.{label}_us"] = invoke
        cases[f"invoke+assemble_32_row_wave.{label}_us"] = invoke_and_assemble
    cases["machine_reference_sum_range_10000_us"] = lambda: sum(range(10_000))
    metrics = round_robin_us(cases, repeats, release_unassembled)
    leaked = len(runtime.backend.ledger.live())
    print(f"{'phase (null model body, 32 x 128 wave)':<44} {'median us':>10}  target")
    for name, value in metrics.items():
        target = "<= 250 us" if name.startswith("prepare") else ("<= 300 us" if "assemble" in name else "")
        print(f"{name:<44} {value:>10.1f}  {target}")
    print(f"(device tensors still live after the run: {leaked})")
    return {"benchmark": "runtime_overhead", "metrics": metrics, "units": {k: "us" for k in metrics}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result = run(200 if args.quick else 2000)
    write_json("runtime_overhead", result["metrics"], result["units"])


if __name__ == "__main__":
    main()
