"""Shared spans beside the plain plan: rows that begin alike, computed once or once per row, on SmolLM2.

    python benchmarks/shared_spans.py [--rounds N] [--dtype float32,bfloat16]

Two runtimes over the same SmolLM2 weights (dequantized from its GGUF, as
``vs_vllm_cpu.py`` loads it), one whose model takes shared writes
(``prefill_core.planning.shared_spans``: the chosen form) and one whose
model declares it does not (the plain form: every row computes all it owes).
Calls alternate which goes first each round; figures are medians, greedy.

* ``chat16``: ``vs_vllm_cpu.py``'s SmolLM2 chat rows, 16 questions behind
  one system prompt whose whole 32-token blocks are cached and shared; the
  rows also share the 11 system-prompt tokens past the last whole block.
* ``n4``: one chat prompt four times, nothing cached (vLLM's ``n = 4``
  samples of one prompt arrive as four rows).

JSON keys ``<dtype>.<case>.chosen_ms`` / ``.plain_ms`` / ``.plain_over_chosen``,
``.chosen_positions`` / ``.plain_positions`` (what each plan computes) and
``.same_tokens`` (rows whose greedy token the two agree on).
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
from benchmarks.vs_vllm_cpu import computed_per_row, smollm2_folder
from prefill_core import SamplingParams


def _cases(tokenizer) -> dict[str, list[list[int]]]:
    from benchmarks._smollm2_throughput import QUESTIONS
    from prefill_shell.cli.demo import SYSTEM
    from prefill_shell.reference.loading.text import Prompt, encode

    chats = [
        encode(
            tokenizer,
            Prompt(messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": q})),
            chat=False,
        )
        for q in QUESTIONS
    ]
    return {"chat16": chats, "n4": [list(chats[0])] * 4}


class Side:
    """One runtime over ``batch`` with the model's shared writes on or off (read when the runtime is built)."""

    def __init__(self, model, batch, block: int, shared: bool):
        from prefill_shell.cli.main import make_runtime

        model.shared_writes = shared
        self.runtime = make_runtime(model, batch, block)
        model.shared_writes = True
        self.batch = batch
        if batch.prefixes:
            self.runtime.prefill(*batch.prefix_call())  # the shared whole blocks, once (a prefix cache's hit)
        self.call = (batch.tokens, batch.page_table, batch.lengths, batch.cached)
        self.positions = sum(computed_per_row(self.runtime, *self.call))

    def __call__(self) -> list:
        greedy = [SamplingParams.greedy()] * len(self.batch.lengths)
        return self.runtime.prefill(*self.call, sampling=greedy)


def run(dtype: str, rounds: int) -> list[Metric]:
    from transformers import AutoTokenizer

    from benchmarks._smollm2_throughput import BLOCK
    from prefill_shell.reference import load_hf_folder
    from prefill_shell.scoring.prefix_sharing import share_prefix

    folder, gguf = smollm2_folder()
    model = load_hf_folder(folder, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    metrics = []
    for name, prompts in _cases(tokenizer).items():
        batch = share_prefix(prompts, BLOCK) if name == "chat16" else share_prefix(prompts, BLOCK, members=[])
        chosen, plain = Side(model, batch, BLOCK, True), Side(model, batch, BLOCK, False)
        same = sum(a.token == b.token for a, b in zip(chosen(), plain()))  # also the warm-up of both
        chosen(), plain()
        times: dict[str, list[float]] = {"chosen": [], "plain": []}
        for r in range(rounds):
            for label, side in (("chosen", chosen), ("plain", plain))[:: 1 if r % 2 == 0 else -1]:
                start = time.perf_counter()
                side()
                times[label].append(time.perf_counter() - start)
        c, p = (statistics.median(times[k]) * 1e3 for k in ("chosen", "plain"))
        key = f"{dtype}.{name}"
        print(f"{key}: shared spans {c:.1f} ms ({chosen.positions} positions), plain {p:.1f} ms ({plain.positions})")
        metrics += [
            Metric(f"{key}.chosen_ms", c, "ms"),
            Metric(f"{key}.plain_ms", p, "ms"),
            Metric(f"{key}.plain_over_chosen", p / c, "x", note=f"{rounds} interleaved rounds"),
            Metric(f"{key}.chosen_positions", chosen.positions, "positions"),
            Metric(f"{key}.plain_positions", plain.positions, "positions"),
            Metric(f"{key}.same_tokens", same, f"of {len(prompts)} rows"),
        ]
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", default="float32,bfloat16")
    ns = parser.parse_args()
    torch.set_num_threads(2)
    metrics = [m for dtype in ns.dtype.split(",") for m in run(dtype, ns.rounds)]
    report("shared_spans", metrics)


if __name__ == "__main__":
    main()
