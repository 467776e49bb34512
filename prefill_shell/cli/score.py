"""``python -m prefill_shell score``: log-likelihoods of continuations (``--pairs``) or documents (``--document``).

``--pairs FILE``: JSON lines with ``context`` and ``continuation`` (text).
Prints one line per pair: its log-likelihood, whether it is the greedy
continuation, and its tokens; then the positions the model body computed
against a run without reuse (one full row per pair, every position).

``--document FILE``: a text file scored as one document over lm-eval's
rolling windows of ``--max-length`` tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prefill_core.values.errors import InvalidScoringRequestError
from prefill_shell.cli import options
from prefill_shell.cli.model_dtype import add_dtype_argument, load_cli_model
from prefill_shell.reference.loading.text import load_tokenizer
from prefill_shell.scoring.scorer import Scorer, encode_pair, prefix_token_id, window_length
from prefill_shell.scoring.setup import scoring_runtime

__all__ = ["add_score_parser", "run_score"]


def add_score_parser(sub) -> None:
    score = sub.add_parser("score", help="log-likelihoods of continuations (--pairs) or of a document (--document)")
    score.add_argument(
        "--model", type=options.model, help="a .gguf file, a Hugging Face folder, or random:NAME (default: SmolLM2)"
    )
    source = score.add_mutually_exclusive_group(required=True)
    source.add_argument("--pairs", help="JSON lines, each with 'context' and 'continuation' text")
    source.add_argument("--document", help="a text file scored over rolling windows of --max-length tokens")
    score.add_argument(
        "--max-length", type=options.count, default=None, help="lm-eval's max_length (default: the model's)"
    )
    score.add_argument("--block-size", type=options.block_size, default=16, help="KV block size (a power of two)")
    score.add_argument("--max-chunk", type=options.count, default=2048, help="the runtime's longest step")
    score.add_argument("--device", default="cpu", type=options.device, help="torch device (cpu or cuda)")
    add_dtype_argument(score)
    score.add_argument("--debug", action="store_true", help="show the traceback of a failure")


def _read_text(path: str | Path) -> str:
    """A UTF-8 file's text (a byte-order mark dropped); bytes that are not UTF-8 name the file."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        msg = f"{path}: is not UTF-8 text (byte {error.start}: {error.reason})"
        raise InvalidScoringRequestError(msg, field="file") from None


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """``(context, continuation)`` per JSON line of text; a line without both as strings names its line number."""
    pairs = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            pair = (item["context"], item["continuation"])
            if not all(isinstance(text, str) for text in pair):
                raise TypeError(f"context and continuation must be strings, got {pair!r}")
            pairs.append(pair)
        except (ValueError, KeyError, TypeError) as error:
            msg = f"{path}:{number}: a pair must be a JSON object with 'context' and 'continuation' strings ({error!r})"
            raise InvalidScoringRequestError(msg, row=number - 1, field="pairs") from None
    return pairs


def _scorer(args: argparse.Namespace, model, max_length: int) -> Scorer:
    """The scoring runtime's layout and policy (``scoring.setup``) on any model the loader returns (a hybrid
    model's pool keeps a buffer per layer, so the scorer's one table per row serves every KV group)."""
    runtime = scoring_runtime(
        model, args.device, max_length=max_length, block_size=args.block_size, max_chunk=args.max_chunk
    )
    return Scorer(runtime, max_length=max_length)


def run_score(args: argparse.Namespace) -> None:
    text_pairs = read_pairs(args.pairs) if args.pairs else None  # bad input fails before the model loads
    document = _read_text(args.document) if args.document else None
    (model, _), tokenizer = load_cli_model(args), load_tokenizer(args.model)
    max_length = window_length(args.max_length, model.spec.max_position, "--max-length")
    if tokenizer is None:
        raise InvalidScoringRequestError(f"--model {args.model!r} has no tokenizer: score needs text", field="model")
    scorer = _scorer(args, model, max_length)
    if document is not None:
        tokens = tokenizer.encode(document)
        (total,) = scorer.score_rolling([tokens], prefix_token_id(tokenizer))
        per_token = total / max(len(tokens), 1)  # an empty document scores 0 over its 0 tokens
        print(f"document: {len(tokens)} tokens, log-likelihood {total:.4f}, per token {per_token:.4f}")
        print(f"positions computed: {scorer.positions_computed}")
        return
    pairs = [encode_pair(tokenizer, c, x) for c, x in text_pairs]
    scores = scorer.score(pairs)
    print(f"{'pair':>4} {'ctx':>5} {'cont':>4} {'log-likelihood':>15} greedy")
    for i, ((context, continuation), score) in enumerate(zip(pairs, scores)):
        print(f"{i:>4} {len(context):>5} {len(continuation):>4} {score.logprob:>15.4f} {score.is_greedy}")
    no_reuse = sum(min(len(c) + len(x), scorer.max_length + 1) for c, x in pairs)
    print(f"positions computed: {scorer.positions_computed} (one full row per pair, no reuse: {no_reuse})")
