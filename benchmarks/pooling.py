"""Embeddings and reranking: prefill-runtime's ``PoolingRunner`` vs sentence-transformers on the same model.

Two cases, each side by side in one process, interleaved (ours, theirs,
ours, ...; medians of ``--rounds``), at float32 and bfloat16:

* ``embed_mixed``: ``--texts`` texts of mixed lengths (log-uniform,
  16-2048 tokens) through a sentence-transformers folder (LAST pooling +
  Normalize) with ``SentenceTransformer.encode`` (its default batch size:
  it sorts by length and pads each batch to its longest text) vs
  ``PoolingRunner.embed`` (packed steps: no padding). Embeddings per second.
* ``rerank_100``: one ``--query-tokens`` query against 100 documents
  (32-256 tokens) through a one-label ``*ForSequenceClassification`` folder
  with ``CrossEncoder.predict`` (which recomputes the query in every pair)
  vs ``PoolingRunner.score`` (the query's whole blocks computed once).
  Pairs per second.

The model is a random Qwen3-shaped checkpoint written by transformers
(hidden 512, 4 layers, 8 query / 4 KV heads of 64, vocabulary 32000) with
a word-level tokenizer, so text lengths are exact token counts. JSON keys:
``<dtype>.<case>.ratio`` (our throughput over sentence-transformers'; goal
>= 1.5 for embed_mixed, >= 3 for rerank_100), ``.ours_per_s``,
``.theirs_per_s``, and ``<dtype>.<case>.max_rel_err`` (ours against theirs,
the vectors or scores of the last round).

    python benchmarks/pooling.py [--rounds N] [--texts N] [--query-tokens N] [--threads N] [--dtype D,...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._report import Metric, report  # noqa: E402

WORDS = 30000
SHAPE = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    pad_token_id=0,
)
GOALS = {"embed_mixed": 1.5, "rerank_100": 3.0}


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": 2 + i for i in range(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)


def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(noise / param.shape[1] ** 0.5 if param.dim() == 2 else 1.0 + 0.1 * noise)


def build_folders(root: Path) -> tuple[Path, Path]:
    """(sentence-transformers folder, cross-encoder folder), written by the libraries themselves."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    body = root / "body"
    lm = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE)).eval()
    _randomize(lm, 0)
    lm.save_pretrained(body)
    _tokenizer(body)
    st_folder = root / "st"
    modules = [Transformer(str(body), max_seq_length=4096), Pooling(SHAPE["hidden_size"], "lasttoken"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(st_folder))
    ce_folder = root / "ce"
    head = transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(**SHAPE, num_labels=1)).eval()
    _randomize(head, 1)
    head.save_pretrained(ce_folder)
    _tokenizer(ce_folder)
    return st_folder, ce_folder


def _text(rnd: random.Random, n: int) -> str:
    return " ".join(f"w{rnd.randrange(WORDS)}" for _ in range(n))


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.float().reshape(len(ours), -1), theirs.float().reshape(len(theirs), -1)
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, theirs))


def run(args: argparse.Namespace) -> list[Metric]:
    from sentence_transformers import CrossEncoder, SentenceTransformer

    from prefill_shell.pooling import PoolingRunner

    rnd = random.Random(0)
    lengths = [round(16 * 128 ** rnd.random()) for _ in range(args.texts)]  # log-uniform in [16, 2048]
    texts = [_text(rnd, n) for n in lengths]
    query = _text(rnd, args.query_tokens)
    documents = [_text(rnd, rnd.randrange(32, 257)) for _ in range(100)]
    metrics: list[Metric] = []
    with tempfile.TemporaryDirectory() as tmp:
        st_folder, ce_folder = build_folders(Path(tmp))
        for dtype in args.dtype.split(","):
            torch_dtype = getattr(torch, dtype)
            st = SentenceTransformer(str(st_folder), device="cpu").to(torch_dtype)
            ce = CrossEncoder(str(ce_folder), device="cpu")
            ce.model.to(torch_dtype)
            options = dict(dtype=dtype, block_size=32, max_chunk=2048, pool_tokens=65536)
            embedder = PoolingRunner.from_folder(st_folder, **options)
            scorer = PoolingRunner.from_folder(ce_folder, **options)
            cases = {
                "embed_mixed": (
                    len(texts),
                    lambda e=embedder: e.embed(texts),
                    lambda m=st: m.encode(texts, convert_to_tensor=True),
                ),
                "rerank_100": (
                    len(documents),
                    lambda r=scorer: r.score(query, documents),
                    lambda m=ce: m.predict([(query, d) for d in documents], convert_to_tensor=True),
                ),
            }
            for case, (count, ours_fn, theirs_fn) in cases.items():
                ours_fn(), theirs_fn()  # warm-up, not timed
                ours_s, theirs_s = [], []
                for _ in range(args.rounds):
                    seconds, ours = _timed(ours_fn)
                    ours_s.append(seconds)
                    seconds, theirs = _timed(theirs_fn)
                    theirs_s.append(seconds)
                ours_rate, theirs_rate = count / statistics.median(ours_s), count / statistics.median(theirs_s)
                prefix = f"{dtype}.{case}"
                unit = "embeddings/s" if case.startswith("embed") else "pairs/s"
                metrics += [
                    Metric(f"{prefix}.ratio", ours_rate / theirs_rate, "x", note=f"goal >= {GOALS[case]}"),
                    Metric(f"{prefix}.ours_per_s", ours_rate, unit),
                    Metric(f"{prefix}.theirs_per_s", theirs_rate, unit),
                    Metric(f"{prefix}.max_rel_err", _rel(torch.as_tensor(ours), torch.as_tensor(theirs)), "rel"),
                ]
                print(f"{prefix}: ours {ours_rate:.2f}/s, sentence-transformers {theirs_rate:.2f}/s", flush=True)
            embedder.close()
            scorer.close()
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--texts", type=int, default=24)
    parser.add_argument("--query-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32,bfloat16")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report("pooling", run(args))


if __name__ == "__main__":
    main()
