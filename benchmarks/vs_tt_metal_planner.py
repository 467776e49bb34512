"""Like for like with tt-metal's prefill planner: its plan vs our ``PrefillRuntime.prepare``.

tt-metal's ``models/common/llm_runtime/prefill/plan.py`` (``tenstorrent/tt-metal``
at commit c00b44ce94c448b162e71940bfddd21684993929)
builds each request's token and page-table tensors while it plans, so ours
is timed as ``prepare`` including every host step value (tokens, starts,
slots, fill and read tables, last-token indices). tt-metal's code is not
part of this project: pass a copy of that file (it imports only torch and
the standard library) with ``--tt-plan``; without it only ours is timed.
Its settings are passed as tt-metal's ``models/common/llm_runtime/config.py`` (at
commit 3514349e4c88d6b2ea16ac821f6c1cc1be6a4bf2)
defaults them: block 32, max batch 32, max chunk 2048, batched prefill on,
max prefill batch 32; ours runs the default ``PrefillPolicy`` on the same
block size, page tables shuffled over an 8192-block pool.

Cases: 1 x 128, 32 x 128, 32 prompts of 20-1000 tokens, one 131072-token
row with 2048 cached. Each sample is the best of a few back-to-back calls;
the two planners alternate sample by sample, medians of the samples, one
torch thread. ``tt/ours`` above 1 means ours is faster.

    python benchmarks/vs_tt_metal_planner.py [--tt-plan PATH] [--rounds N]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import write_json
from benchmarks.runtime_overhead import HIDDEN, VOCAB, NullBody, NullKV
from prefill_core import PageTableLayout, PrefillPolicy, ceil_div
from prefill_shell.backends import TorchBackend
from prefill_shell.device.model import ModelSpec
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.runtime import PrefillRuntime

BLOCK, POOL, LONG = 32, 8192, 131072


class PoolKV(NullKV):
    num_blocks = POOL


class LongBody(NullBody):
    """The null body with room for a 131072-token row."""

    def __init__(self):
        super().__init__()
        self.spec = ModelSpec(VOCAB, HIDDEN, 1, 1, 1, HIDDEN, LONG)


def cases(rng: random.Random) -> dict[str, tuple]:
    """Each case's ``(tokens, page_table, lengths, cached)``; every row maps its own shuffled blocks."""

    def case(lengths: list[int], cached: list[int]) -> tuple:
        need = [ceil_div(n, BLOCK) for n in lengths]
        ids = rng.sample(range(POOL), sum(need))
        table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
        first = 0
        for row, n in enumerate(need):
            table[row, :n] = torch.tensor(ids[first : first + n], dtype=torch.int32)
            first += n
        tokens = torch.randint(1, VOCAB, (len(lengths), max(lengths)))
        return tokens, table, lengths, cached

    mixed = [rng.randint(20, 1000) for _ in range(32)]
    return {
        "1x128": case([128], [0]),
        "32x128": case([128] * 32, [0] * 32),
        "32_mixed_20-1000": case(mixed, [0] * 32),
        "131072_cached_2048": case([LONG], [2048]),
    }


def load_tt_planner(path: Path):
    """tt-metal's ``_plan_prefill_requests`` from a copy of its plan.py, called with its config defaults."""
    spec = importlib.util.spec_from_file_location("tt_metal_prefill_plan", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the file runs
    spec.loader.exec_module(module)

    def plan(tokens, table, lengths, cached):
        return module._plan_prefill_requests(
            tokens=tokens,
            page_table=table,
            prompt_lens=torch.tensor(lengths),
            empty_slots=None,
            start_pos=torch.tensor(cached),
            block_size=BLOCK,
            max_batch_size=32,
            max_prefill_chunk_size=2048,
            supports_batched_prefill=True,
            max_prefill_batch_size=32,
        )

    return plan


def best_of_us(fn, args: tuple, calls: int) -> float:
    """The best per-call time of three runs of ``calls`` back-to-back calls."""
    return min(timeit.repeat(lambda: fn(*args), number=calls, repeat=3)) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tt-plan", type=Path, help="a copy of tt-metal's llm_runtime/prefill/plan.py")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    layout = PageTableLayout(BLOCK, LONG // BLOCK, POOL)
    runtime = PrefillRuntime(
        PrefillRuntimeConfig.resolve(LongBody(), TorchBackend(), PoolKV(), layout, PrefillPolicy())
    )
    planners = {"ours": runtime.prepare}
    if args.tt_plan is not None:
        planners["tt-metal"] = load_tt_planner(args.tt_plan)
    metrics, units = {}, {}
    print(f"{'case':<20} {'tt-metal us':>12} {'ours us':>9} {'tt/ours':>8}")
    for name, case in cases(random.Random(0)).items():
        calls = 10 if name.startswith("131072") else 50
        samples: dict[str, list[float]] = {who: [] for who in planners}
        for fn in planners.values():
            fn(*case)  # warm
        for round_ in range(args.rounds):
            order = list(planners) if round_ % 2 == 0 else list(reversed(planners))
            for who in order:
                samples[who].append(best_of_us(planners[who], case, calls))
        ours = statistics.median(samples["ours"])
        metrics[f"{name}.ours_us"], units[f"{name}.ours_us"] = ours, "us"
        if "tt-metal" in samples:
            theirs = statistics.median(samples["tt-metal"])
            metrics[f"{name}.tt_metal_us"], units[f"{name}.tt_metal_us"] = theirs, "us"
            metrics[f"{name}.tt_over_ours"], units[f"{name}.tt_over_ours"] = theirs / ours, "ratio"
            print(f"{name:<20} {theirs:>12.0f} {ours:>9.0f} {theirs / ours:>7.2f}x")
        else:
            print(f"{name:<20} {'-':>12} {ours:>9.0f} {'-':>8}")
    if args.tt_plan is None:
        print("no --tt-plan given: only ours was timed")
    write_json("vs_tt_metal_planner", metrics, units)
    return 0


if __name__ == "__main__":
    sys.exit(main())
