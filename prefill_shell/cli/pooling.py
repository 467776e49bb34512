"""``python -m prefill_shell embed`` and ``rerank``: embeddings of a file, and documents ranked for a query.

``embed --model FOLDER --input FILE --output OUT``: every text of ``FILE``
(one per line, or JSON lines with ``text`` when the suffix is
``.jsonl``/``.ndjson``) through a sentence-transformers (or causal-LM)
folder's pooling, written as a float32 ``[N, D]`` array (``OUT.npy``) or
JSON lines ``{"index": i, "embedding": [...]}`` (``OUT.jsonl``). Progress
goes to stderr as rows finish.

``rerank --model FOLDER --query TEXT --documents FILE``: each document's
score for the query (a cross-encoder's one-label head, or the
Qwen3-Reranker yes/no recipe on a causal LM), best first, the query's
blocks computed once. Prints ``rank score index text``, or JSON lines with
``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prefill_core.values.pooling import InvalidPoolingError
from prefill_shell.cli import options
from prefill_shell.pooling import PoolingRunner

__all__ = ["add_pooling_parsers", "read_texts", "run_embed", "run_rerank"]

_JSONL = (".jsonl", ".ndjson")
_DTYPES = ("float32", "bfloat16", "float16")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=options.model, required=True, help="a sentence-transformers, classification or causal-LM folder"
    )
    parser.add_argument("--block-size", type=options.block_size, default=32, help="KV block size (a power of two)")
    parser.add_argument("--max-chunk", type=options.count, default=512, help="the runtime's longest step")
    parser.add_argument("--device", default="cpu", type=options.device, help="torch device (cpu or cuda)")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32", help="model dtype (default float32)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")


def add_pooling_parsers(sub) -> None:
    embed = sub.add_parser("embed", help="embed every text of a file (one per line, or JSON lines) to .npy or .jsonl")
    embed.add_argument("--input", required=True, metavar="FILE", help="texts: one per line, or .jsonl with 'text'")
    embed.add_argument("--output", required=True, metavar="OUT", help="OUT.npy (float32 [N, D]) or OUT.jsonl")
    embed.add_argument("--dimensions", type=options.count, default=None, help="Matryoshka truncation")
    norm = embed.add_mutually_exclusive_group()
    norm.add_argument("--normalize", dest="normalize", action="store_true", default=None, help="L2-normalise")
    norm.add_argument("--no-normalize", dest="normalize", action="store_false", help="do not normalise")
    _common(embed)
    rerank = sub.add_parser("rerank", help="score documents for a query, best first (the query computed once)")
    rerank.add_argument("--query", required=True, help="the query text")
    rerank.add_argument("--documents", required=True, metavar="FILE", help="documents: one per line, or .jsonl")
    rerank.add_argument("--top-n", type=options.count, default=None, help="print only the best N")
    rerank.add_argument("--instruction", default=None, help="the Qwen3-Reranker instruction (causal-LM folders)")
    rerank.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    _common(rerank)


def read_texts(path: str | Path) -> list[str]:
    """The texts of a file: one per non-empty line, or JSON lines with a ``text`` string (``.jsonl``/``.ndjson``)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as error:
        raise InvalidPoolingError(f"{path}: is not UTF-8 text (byte {error.start})", field="input") from None
    if path.suffix.lower() not in _JSONL:
        return [line for line in lines if line.strip()]
    texts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
            if not isinstance(text, str):
                raise TypeError(f"'text' is a {type(text).__name__}")
        except (ValueError, KeyError, TypeError) as error:
            msg = f"{path}:{number}: a line must be a JSON object with a 'text' string ({error!r})"
            raise InvalidPoolingError(msg, row=number - 1, field="input") from None
        texts.append(text)
    return texts


def _runner(args: argparse.Namespace) -> PoolingRunner:
    start = time.perf_counter()
    runner = PoolingRunner.from_folder(
        args.model, dtype=args.dtype, device=args.device, block_size=args.block_size, max_chunk=args.max_chunk
    )
    took = time.perf_counter() - start
    print(f"[load model] {args.model} ({args.dtype}) in {took:.1f} s", file=sys.stderr, flush=True)
    return runner


def _progress(label: str):
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        rate = done / max(time.perf_counter() - start, 1e-9)
        print(f"  {label} {done}/{total} ({rate:.1f}/s)", file=sys.stderr, flush=True)

    return report


def run_embed(args: argparse.Namespace) -> None:
    output = Path(args.output)
    if output.suffix.lower() not in (".npy", *_JSONL):
        raise InvalidPoolingError(f"--output {output}: name a .npy or .jsonl file", field="output")
    texts = read_texts(args.input)  # a bad file is reported before the model loads
    runner = _runner(args)
    vectors = runner.embed(texts, dimensions=args.dimensions, normalize=args.normalize, on_progress=_progress("embed"))
    if output.suffix.lower() == ".npy":
        import numpy as np

        np.save(output, vectors.numpy())
    else:
        with output.open("w", encoding="utf-8") as fh:
            for index, vector in enumerate(vectors.tolist()):
                fh.write(json.dumps({"index": index, "embedding": vector}) + "\n")
    print(f"[embed] {len(texts)} texts -> {output} ({tuple(vectors.shape)})", file=sys.stderr, flush=True)
    runner.close()


def run_rerank(args: argparse.Namespace) -> None:
    documents = read_texts(args.documents)
    runner = _runner(args)
    ranked = runner.rerank(
        args.query, documents, top_n=args.top_n, instruction=args.instruction, on_progress=_progress("rerank")
    )
    for rank, (index, score) in enumerate(ranked, start=1):
        if args.json:
            print(json.dumps({"rank": rank, "index": index, "score": score, "text": documents[index]}))
        else:
            print(f"{rank:>4}  {score:.6f}  {index:>5}  {documents[index][:80]}")
    runner.close()
