"""``python -m prefill_shell run``: prompts in, next tokens out, on the torch backend
(``python -m prefill_shell score``: log-likelihoods, see ``score_cli``).

With prompts (``--prompt``, ``--prompts FILE``, ``--token-ids FILE``) it
prefills them as one batch (rows that start with the same first block form
a group; each group's common whole blocks are prefilled once and its rows
run with them cached)
and prints, per row, the prompt length, the tokens taken from cache, the
five most likely next tokens with log-probs and one sampled token. Without
prompts it runs the demo (``prefill_shell.cli.demo``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence

import torch

from prefill_core import PageTableLayout, SamplingParams
from prefill_shell.backends import TorchBackend
from prefill_shell.cli.args import build_parser, failure_message
from prefill_shell.cli.model_dtype import load_cli_model
from prefill_shell.cli.score import run_score
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.progress import Progress
from prefill_shell.engine.result import PrefillResult
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference.loading.text import (
    Prompt,
    PromptError,
    encode,
    load_tokenizer,
    read_prompt_file,
    read_token_id_lines,
    token_text,
)
from prefill_shell.scoring.prefix_sharing import SharedPrefixBatch, share_prefixes, sharing_groups

__all__ = ["check_prompts", "main", "make_runtime", "print_rows", "run_main", "score_main", "show_progress", "stage"]


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

    (On the CPU that is ``PrefillPolicy.fine_rungs``: padding is pure extra work there.) Any model the loader
    returns: a hybrid one's pool keeps a buffer per layer (``new_kv_cache(num_blocks, block_size)``), so the
    command's one page table per row serves every KV group (``prefill_core.plan_call``).
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
        sampled = token_text(tokenizer, result.token)
        print(f"{i:>3} {label:<10} {batch.lengths[i]:>5} {batch.cached[i]:>6}  {top:<70} {sampled}")


def _prompts(args: argparse.Namespace, tokenizer) -> list[tuple[str, list[int]]]:
    """``(source, token ids)`` per prompt: each ``--prompt``, then each ``--prompts`` file, then ``--token-ids``."""
    prompts = [Prompt(text=text, source=f"--prompt #{n}") for n, text in enumerate(args.prompt or (), 1)]
    for path in args.prompts or ():
        prompts += read_prompt_file(path)
    out = [(p.source, encode(tokenizer, p, args.chat)) for p in prompts]
    for path in args.token_ids or ():
        out += read_token_id_lines(path)
    for source, ids in out:
        if not ids:
            raise PromptError(f"prompt {source} is empty (0 tokens): give it some text")
    return out


def check_prompts(prompts: Sequence[tuple[str, list[int]]], spec) -> None:
    """Each prompt fits the model's context and holds only ids of its vocabulary."""
    for source, ids in prompts:
        if len(ids) > spec.max_position:
            raise PromptError(
                f"prompt {source} has {len(ids)} tokens, more than the model's context of "
                f"{spec.max_position}: shorten it"
            )
        if max(ids) >= spec.vocab_size:
            raise PromptError(
                f"prompt {source}: token id {max(ids)} is outside the model's vocabulary [0, {spec.vocab_size})"
            )


def run_prompts(args: argparse.Namespace) -> None:
    """Prefills the given prompts as one batch and prints each row's next tokens."""
    # Prompts first: a bad file or prompt is reported before the slow model load.
    with stage("load tokenizer"):
        tokenizer = load_tokenizer(args.model)
    prompts = _prompts(args, tokenizer)
    with stage("load model"):
        model, _ = load_cli_model(args)
    check_prompts(prompts, model.spec)
    ids = [p for _, p in prompts]
    batch = share_prefixes(ids, args.block_size, sharing_groups(ids, args.block_size))
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
    """Runs the command line; every failure is one ``error:`` line on stderr (exit 2 for usage, 1 otherwise)."""
    args = build_parser().parse_args(argv)
    try:
        torch.manual_seed(getattr(args, "seed", 0))
        if args.command == "score":
            run_score(args)
        elif args.command in ("embed", "rerank"):
            from prefill_shell.cli.pooling import run_embed, run_rerank

            (run_embed if args.command == "embed" else run_rerank)(args)
        elif args.prompt or args.prompts or args.token_ids:
            run_prompts(args)
        else:
            from prefill_shell.cli.demo import run_demo  # the demo imports this module's helpers

            run_demo(args)
    except (Exception, KeyboardInterrupt) as error:
        if getattr(args, "debug", False):
            raise
        print(f"error: {failure_message(error)}", file=sys.stderr, flush=True)
        raise SystemExit(130 if isinstance(error, KeyboardInterrupt) else 1) from None


def run_main() -> None:
    """The ``prefill-run`` console script: ``python -m prefill_shell run`` with the same arguments."""
    main(["run", *sys.argv[1:]])


def score_main() -> None:
    """The ``prefill-score`` console script: ``python -m prefill_shell score`` with the same arguments."""
    main(["score", *sys.argv[1:]])
