"""The serving facade: its host overhead over the direct runtime, and what a scheduler's steps compute.

1. Overhead, with a null model body (as ``runtime_overhead.py``): one
   32 x 128 wave through ``ServingFacade.prefill_forward`` (the plugin's
   keywords, tensors as it sends them) against the same call through
   ``PrefillExecutor.prefill``, logits and greedy (plugin encoding
   ``top_k=1, top_p=0.0``), sampled round-robin; target: median ratio
   facade / direct <= 1.05.
2. Positions computed per scheduled prompt token under the vLLM-like test
   scheduler (tests/e2e/vllm_like_scheduler.py, 44 requests, budgets 256
   and 2048): the plan's device positions (padding included) and, of
   those, the positions an unaligned start recomputes
   (``PrefillRequest.recomputed_tokens``). Counted from each step's plan;
   exact and machine-independent.

    python benchmarks/serving.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import write_json
from benchmarks.runtime_overhead import BLOCK, LENGTH, ROWS, VOCAB, NullBody, NullKV, round_robin_us
from prefill_core import PrefillPolicy, SamplingParams
from prefill_shell.backends import TorchBackend
from prefill_shell.reference import random_llama
from prefill_shell.serving.facade import ServingFacade
from tests.e2e.vllm_like_scheduler import BlockPool, Scheduler, SimRequest

SCHEDULER_BLOCK, MAX_SEQS = 16, 16
POLICY = PrefillPolicy(max_chunk_length=256, chunk_quantum=128, length_ladder=(128, 256), waves=(1, 2, 4, 8))


def overhead(repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    body = NullBody()
    facade = ServingFacade(
        body, TorchBackend(), max_seq_len=2048, policy=PrefillPolicy(), kv_factory=lambda *_: NullKV()
    )
    kv = facade.allocate_kv_cache((NullKV.num_blocks, 1, BLOCK, body.spec.head_dim), body.dtype, 1)
    executor = facade.executor
    tokens = torch.randint(1, VOCAB, (ROWS, LENGTH))
    table = torch.arange(NullKV.num_blocks, dtype=torch.int32).reshape(ROWS, -1)
    lens, starts, slots = torch.full((ROWS,), LENGTH), torch.zeros(ROWS, dtype=torch.int64), list(range(ROWS))
    greedy_plugin = SimpleNamespace(temperature=[0.0] * ROWS, top_k=[1] * ROWS, top_p=[0.0] * ROWS)
    greedy_core = [SamplingParams.greedy()] * ROWS
    cases = {}
    for label, plugin, core in (("logits", None, None), ("greedy", greedy_plugin, greedy_core)):

        def facade_call(plugin=plugin):
            facade.prefill_forward(
                tokens,
                table,
                kv_cache=kv,
                enable_trace=False,
                prompt_lens=lens,
                start_pos=starts,
                empty_slots=slots,
                sampling_params=plugin,
            )

        def direct_call(core=core):
            executor.prefill(tokens, table, lens, starts, slots, core, mode="eager")

        cases[f"direct_32x128.{label}_us"] = direct_call
        cases[f"facade_32x128.{label}_us"] = facade_call
    cases["machine_reference_sum_range_10000_us"] = lambda: sum(range(10_000))
    metrics = round_robin_us(cases, repeats)
    for label in ("logits", "greedy"):
        metrics[f"ratio_facade_over_direct.{label}"] = (
            metrics[f"facade_32x128.{label}_us"] / metrics[f"direct_32x128.{label}_us"]
        )
    return metrics


def _requests(count: int = 44) -> list[SimRequest]:
    """The scheduler test's workload: groups of twelve, most behind one of three shared system prompts."""
    rng = random.Random(0)

    def tokens(n, seed):
        return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed))

    systems = [tokens(n, 900 + i) for i, n in enumerate((40, 75, 100))]
    out = []
    for i in range(count):
        group = i // 12
        head = None if group % 4 == 3 else systems[group % 3]
        tail = tokens(rng.choice((rng.randint(5, 160), rng.randint(160, 400))), 1000 + i)
        out.append(SimRequest(i, tail if head is None else torch.cat([head, tail]), 2 * group, i))
    return out


def positions(budget: int, num_blocks: int) -> dict[str, float]:
    """Scheduled prompt tokens, and the plan's computed and recomputed positions, over a whole run."""
    model = random_llama(0, "tiny")
    facade = ServingFacade(model, TorchBackend(), max_seq_len=512, max_batch_size=MAX_SEQS, policy=POLICY)
    spec = model.spec
    facade.allocate_kv_cache((num_blocks, spec.num_kv_heads, SCHEDULER_BLOCK, spec.head_dim), model.dtype, 2)
    requests = _requests()
    scheduler = Scheduler(
        requests, BlockPool(num_blocks, SCHEDULER_BLOCK), budget=budget, max_num_seqs=MAX_SEQS, decode_steps=8
    )
    scheduled_tokens = computed = recomputed = 0
    for now in range(1000):
        if scheduler.idle:
            break
        step = scheduler.step(now)
        if not step:
            continue
        rows = [r for r, _ in step]
        matrix = torch.zeros(len(rows), max(len(r.tokens) for r in rows), dtype=torch.int64)
        table = torch.full((len(rows), 32), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            matrix[i, : len(r.tokens)] = r.tokens
            table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        ends, starts = [r.computed + n for r, n in step], [r.computed for r in rows]
        batch = facade.runtime.prepare(matrix, table, ends, starts, [r.slot for r in rows])  # plans, runs nothing
        computed += sum(p.request.computed_tokens for p in batch.requests)
        recomputed += sum(p.request.recomputed_tokens for p in batch.requests)
        scheduled_tokens += sum(n for _, n in step)
        for r, n in step:
            r.computed += n
            if r.computed == len(r.tokens):
                scheduler.prefilled(r)
    return {
        "scheduled_prompt_tokens": scheduled_tokens,
        "computed_per_token": computed / scheduled_tokens,
        "recomputed_per_token": recomputed / scheduled_tokens,
        **{k: float(v) for k, v in scheduler.stats.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    metrics = overhead(31 if args.quick else 201)
    print(f"{'facade overhead (null model body, 32 x 128 wave)':<52} {'median us':>10}  target")
    for name, value in metrics.items():
        target = "<= 1.05" if name.startswith("ratio") else ""
        shown = f"{value:>10.3f}" if name.startswith("ratio") else f"{value:>10.1f}"
        print(f"{name:<52} {shown}  {target}")
    print(f"\n{'scheduler (44 requests)':<26} {'tokens':>7} {'computed/token':>15} {'recomputed/token':>17}  counts")
    for budget, num_blocks in ((256, 64), (2048, 176)):
        counted = positions(budget, num_blocks)
        for name, value in counted.items():
            metrics[f"budget_{budget}.{name}"] = value
        extra = {k: int(v) for k, v in counted.items() if k not in ("computed_per_token", "recomputed_per_token")}
        print(
            f"{'budget ' + str(budget):<26} {counted['scheduled_prompt_tokens']:>7} "
            f"{counted['computed_per_token']:>15.3f} {counted['recomputed_per_token']:>17.4f}  {extra}"
        )
    write_json("serving", metrics, {name: _unit(name) for name in metrics})


def _unit(name: str) -> str:
    if name.endswith("_us"):
        return "us"
    if name.startswith("ratio") or name.endswith("per_token"):
        return "ratio"
    return "count"


if __name__ == "__main__":
    main()
