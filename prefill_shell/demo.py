"""The main job: a real prefill of a mixed batch on the torch backend.

``python -m prefill_shell run`` builds the embedded default (a seeded
random-weight "demo" Llama, a batch of short, long-chunked and
prefix-cached prompts), prints the plan, runs it eagerly and traced, and
prints each row's first token, log-prob and top-5 with per-phase timings.
``--model DIR`` loads a local Hugging Face Llama; ``--prompts FILE`` reads
one prompt per line (token ids, or text when DIR holds a tokenizer.json).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams, WarmupManifest
from prefill_core.explain import plan_table

from .backends import TorchBackend
from .config import PrefillRuntimeConfig
from .executor import PrefillExecutor
from .reference import load_hf_folder, random_llama
from .runtime import PrefillRuntime

__all__ = ["main"]

DEFAULT_LENGTHS = (37, 120, 128, 700, 5000, 3000)
DEFAULT_CACHED = (0, 0, 0, 0, 0, 2048)


def _prompts(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    if args.prompts is None:
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in DEFAULT_LENGTHS]
        return prompts, list(DEFAULT_CACHED)
    lines = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    tokenizer_file = Path(args.model or "") / "tokenizer.json"
    if all(part.strip().lstrip("-").isdigit() for line in lines for part in line.split()):
        prompts = [[int(t) for t in line.split()] for line in lines]
    elif args.model and tokenizer_file.exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        prompts = [tokenizer.encode(line).ids for line in lines]
    else:
        raise SystemExit(f"{args.prompts}: text prompts need --model DIR with a tokenizer.json")
    return prompts, [0] * len(prompts)


def _page_table(lengths: list[int], block_size: int) -> tuple[torch.Tensor, int]:
    """Disjoint blocks per row, in order; returns the table and the blocks used."""
    need = [-(-n // block_size) for n in lengths]
    table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
    first = 0
    for row, n in enumerate(need):
        table[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    return table, first


def _timed(label: str, timings: dict, fn):
    start = time.perf_counter()
    value = fn()
    timings[label] = time.perf_counter() - start
    return value


def run(args: argparse.Namespace) -> None:
    model = load_hf_folder(args.model) if args.model else random_llama(args.seed, "demo")
    prompts, cached = _prompts(args, model.spec.vocab_size)
    lengths = [len(p) for p in prompts]
    table, used = _page_table(lengths, args.block_size)
    kv = model.new_kv_cache(used, args.block_size)
    layout = PageTableLayout(args.block_size, -(-max(max(lengths), 1) // args.block_size), used)
    policy = PrefillPolicy(max_chunk_length=args.max_chunk, length_ladder=(128, 256, 512, 1024))
    runtime = PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(args.device), kv, layout, policy))
    executor = PrefillExecutor(runtime)
    sampling = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=row, num_logprobs=5) for row in range(len(prompts))]
    sampling[0] = SamplingParams.greedy(num_logprobs=5)

    # Put the cached prefixes in the KV pool first (what an earlier request would have left).
    prefixes = [row for row, c in enumerate(cached) if c]
    if prefixes:
        runtime.prefill([prompts[r][: cached[r]] for r in prefixes], table[prefixes], [cached[r] for r in prefixes])

    timings: dict[str, float] = {}
    batch = _timed("prepare", timings, lambda: runtime.prepare(prompts, table, lengths, cached, None, sampling))
    print(f"model: {args.model or 'seeded random demo Llama'} {model.spec}\n")
    print(plan_table(batch.prepared), "\n")
    eager = _timed("eager invoke+assemble", timings, lambda: runtime.assemble(executor.invocations(batch, "eager"), batch.num_rows))
    manifest = WarmupManifest().observe(batch.prepared)
    _timed("warm-up (compile + capture)", timings, lambda: executor.warm_up(manifest))
    traced = _timed("traced invoke+assemble", timings, lambda: runtime.assemble(executor.invocations(batch, "traced"), batch.num_rows))

    print(f"{'row':>3} {'len':>5} {'cached':>6}  {'token':>6} {'logprob':>8}  top-5 (token:logprob)")
    for result in eager:
        top = " ".join(f"{t}:{lp:.2f}" for t, lp in result.top_logprobs)
        print(f"{result.row:>3} {lengths[result.row]:>5} {cached[result.row]:>6}  {result.token:>6} {result.logprob:>8.3f}  {top}")
    same = all(e.token == t.token and e.logprob == t.logprob for e, t in zip(eager, traced))
    print(f"\ntraced results identical to eager: {same}")
    print("\nphase timings (ms):")
    for label, seconds in timings.items():
        print(f"  {label:<28} {seconds * 1e3:9.1f}")
    real = sum(p.request.real_tokens for p in batch.prepared)
    print(f"  eager tokens/s {real / timings['eager invoke+assemble']:,.0f}   traced tokens/s {real / timings['traced invoke+assemble']:,.0f}")
    executor.close()
    print(f"live device tensors after close: {len(runtime.backend.ledger.live())}")
    if not same:
        raise SystemExit("traced results differ from eager")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_shell")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("run", help="prefill a batch on the torch backend and print plan, results, timings")
    demo.add_argument("--model", help="local Hugging Face Llama folder (config.json + safetensors)")
    demo.add_argument("--prompts", help="file with one prompt per line (token ids, or text with --model)")
    demo.add_argument("--device", default="cpu", help="torch device (cpu or cuda)")
    demo.add_argument("--block-size", type=int, default=32)
    demo.add_argument("--max-chunk", type=int, default=2048)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    run(args)
