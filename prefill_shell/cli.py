"""``python -m prefill_shell run``: prompts in, next tokens out, on the torch backend
(``python -m prefill_shell score``: log-likelihoods, see ``score_cli``).

With prompts (``--prompt``, ``--prompts FILE``, ``--token-ids FILE``) it
prefills them as one batch (rows that start with the same whole blocks
share them: that prefix is prefilled once and the rows run with it cached)
and prints, per row, the prompt length, the tokens taken from cache, the
five most likely next tokens with log-probs and one sampled token. Without
prompts it runs the demo (``prefill_shell.demo``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence

import torch

from prefill_core import PageTableLayout, SamplingParams
from prefill_core.errors import PrefillError

from .backends import TorchBackend
from .config import PrefillRuntimeConfig
from .prefix_sharing import SharedPrefixBatch, largest_sharing_group, share_prefix
from .progress import Progress
from .result import PrefillResult
from .runtime import PrefillRuntime
from .score_cli import add_score_parser, run_score
from .text import (
    Prompt,
    PromptError,
    encode,
    load_model,
    load_tokenizer,
    read_prompt_file,
    read_token_id_file,
    token_text,
)

__all__ = ["main", "make_runtime", "print_rows", "show_progress", "stage"]


@contextlib.contextmanager
def stage(label: str) -> Iterator[None]:
    """A long step's start and duration, on stderr so stdout stays the result."""
    print(f"[{label}] ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"[{label}] done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def show_progress(progress: Progress) -> None:
    """An ``on_progress`` callback: one stderr line per finished unit (``done/total``) of a runtime stage."""
    if progress.done:
        print(f"  {progress.stage} {progress.done}/{progress.total} {progress.detail}", file=sys.stderr, flush=True)


def make_runtime(model, batch: SharedPrefixBatch, block_size: int, device: str = "cpu") -> PrefillRuntime:
    """A runtime whose KV pool holds exactly ``batch``'s blocks, with the backend's preferred policy.

    (On the CPU that is ``PrefillPolicy.fine_rungs``: padding is pure extra work there.)
    """
    kv = model.new_kv_cache(batch.num_blocks, block_size)
    layout = PageTableLayout(block_size, batch.max_blocks_per_row, batch.num_blocks)
    return PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(device), kv, layout))


def row_sampling(rows: int, seed: int) -> list[SamplingParams]:
    """Per row: top-5 log-probs and one token sampled at temperature 0.7 from the 20 most likely."""
    return [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=seed + row, num_logprobs=5) for row in range(rows)
    ]


def print_rows(
    results: Sequence[PrefillResult], batch: SharedPrefixBatch, tokenizer, labels: Sequence[str] = ()
) -> None:
    """One line per row: length, cached tokens, top-5 next tokens with log-probs, the sampled token."""
    print(f"{'row':>3} {'label':<10} {'len':>5} {'cached':>6}  {'next tokens (log-prob)':<70} sampled")
    for result in results:
        i = result.row
        top = "  ".join(f"{token_text(tokenizer, t)} {lp:.2f}" for t, lp in result.top_logprobs)
        label = labels[i] if i < len(labels) else ""
        print(
            f"{i:>3} {label:<10} {batch.lengths[i]:>5} {batch.cached[i]:>6}  {top:<70} {token_text(tokenizer, result.token)}"
        )


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    prompts = [Prompt(text=text) for text in args.prompt or ()]
    if args.prompts:
        prompts += read_prompt_file(args.prompts)
    ids = [encode(tokenizer, p, args.chat) for p in prompts]
    if args.token_ids:
        ids += read_token_id_file(args.token_ids)
    return ids


def run_prompts(args: argparse.Namespace) -> None:
    """Prefills the given prompts as one batch and prints each row's next tokens."""
    with stage("load model"):
        model, tokenizer = load_model(args.model, device=args.device), load_tokenizer(args.model)
    ids = _prompt_ids(args, tokenizer)
    batch = share_prefix(ids, args.block_size, largest_sharing_group(ids, args.block_size))
    runtime = make_runtime(model, batch, args.block_size, args.device)
    with stage(f"prefill {len(ids)} prompts, {sum(batch.lengths)} tokens"):
        if batch.prefix_tokens:
            runtime.prefill(*batch.prefix_call(), on_progress=show_progress)  # fills the shared blocks once
        results = runtime.prefill(
            batch.tokens,
            batch.page_table,
            batch.lengths,
            batch.cached,
            sampling=row_sampling(len(ids), args.seed),
            on_progress=show_progress,
        )
    print_rows(results, batch, tokenizer)
    runtime.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_shell")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="prefill prompts (or, without any, the demo batch) and print next tokens")
    run.add_argument(
        "--model", help="a .gguf file, a Hugging Face folder, or random:NAME (default: the pinned SmolLM2)"
    )
    run.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    run.add_argument(
        "--prompts", help="a file: one prompt per line, or .jsonl objects with 'prompt' or chat 'messages'"
    )
    run.add_argument("--token-ids", help="a file of prompts as space-separated token ids, one per line")
    run.add_argument("--chat", action="store_true", help="apply the model's chat template to plain prompts")
    run.add_argument("--device", default="cpu", help="torch device (cpu or cuda)")
    run.add_argument("--block-size", type=int, default=32)
    run.add_argument("--seed", type=int, default=0)
    add_score_parser(sub)
    args = parser.parse_args(argv)
    torch.manual_seed(getattr(args, "seed", 0))
    try:
        if args.command == "score":
            run_score(args)
        elif args.prompt or args.prompts or args.token_ids:
            run_prompts(args)
        else:
            from .demo import run_demo  # the demo imports this module's helpers

            run_demo(args)
    except (PromptError, PrefillError, OSError) as error:  # bad input or set-up: a message, not a traceback
        raise SystemExit(f"error: {error}") from None
