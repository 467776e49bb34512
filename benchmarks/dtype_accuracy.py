"""Accuracy at each dtype against float32 transformers: the figures of ``docs/dtypes.md``.

Model: SmolLM2-135M-Instruct from its pinned GGUF file (``make model``),
loaded by this project and by transformers from the same file.

1. Last-token logits: 16 cuts of the demo's weather log (64, 128, ... 1024
   tokens) and the demo's 11 prompts (chat over a shared system prompt, a
   2,300-token document, short questions), run through the runtime at each
   dtype (eager, packed steps; the shared system prompt cached), against
   transformers at float32 on each whole prompt. Per dtype: the largest
   absolute logit difference, the largest difference of a row's log-softmax
   at its oracle top-1 token, and how many rows pick the same argmax. The
   same figures for transformers itself at bfloat16 / float16 calibrate them:
   that is how far the oracle's own low-precision run drifts.
2. lm-eval accuracy on the local tasks (``evals/``): ``prefill_mc`` (acc)
   and ``prefill_rolling`` (word perplexity) for ``prefill-runtime`` and lm-eval's
   ``hf`` model at each dtype.

    python benchmarks/dtype_accuracy.py [--dtypes float32,bfloat16,float16] [--no-lm-eval]

Writes ``benchmarks/results/dtype_accuracy.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._report import write_json  # noqa: E402
from prefill_shell.backends.numerics import probe_numerics  # noqa: E402
from prefill_shell.cli.demo import demo_prompts, document  # noqa: E402
from prefill_shell.cli.main import make_runtime  # noqa: E402
from prefill_shell.reference.loading.gguf import load_gguf  # noqa: E402
from prefill_shell.reference.loading.smollm2 import smollm2_path  # noqa: E402
from prefill_shell.scoring.prefix_sharing import share_prefix  # noqa: E402

BLOCK = 32
CUTS = tuple(range(64, 1025, 64))


def prompts(tokenizer) -> tuple[list[list[int]], list[int]]:
    """Token ids of every row and the rows that share the demo's system prompt."""
    log = tokenizer(document())["input_ids"]
    ids, _, members = demo_prompts(tokenizer, tokenizer.vocab_size)
    return [log[:n] for n in CUTS] + ids, [len(CUTS) + m for m in members]


def ours_logits(path: Path, dtype: str, ids: list[list[int]], members: list[int]) -> torch.Tensor:
    """``[rows, vocab]`` float32 last-token logits of the runtime at ``dtype``."""
    model = load_gguf(path, dtype=getattr(torch, dtype))
    batch = share_prefix(ids, BLOCK, members)
    runtime = make_runtime(model, batch, BLOCK)
    runtime.prefill(*batch.prefix_call())
    results = runtime.prefill(batch.tokens, batch.page_table, batch.lengths, batch.cached)
    runtime.close()
    return torch.stack([r.logits for r in results]).float()


def hf_logits(hf, ids: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.stack([hf(torch.tensor([row]), logits_to_keep=1).logits[0, -1] for row in ids]).float()


def compare(logits: torch.Tensor, oracle: torch.Tensor) -> dict[str, float]:
    """Largest |logit diff|, largest |log-prob diff| at the oracle's top-1 token, argmax agreement."""
    top = oracle.argmax(-1, keepdim=True)
    logprob = (logits.log_softmax(-1).gather(-1, top) - oracle.log_softmax(-1).gather(-1, top)).abs().max()
    return {
        "max_logit_diff": (logits - oracle).abs().max().item(),
        "max_top1_logprob_diff": logprob.item(),
        "argmax_agree": (logits.argmax(-1) == oracle.argmax(-1)).float().mean().item(),
    }


def logit_rows(dtypes: list[str]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids, members = prompts(tokenizer)

    def hf_at(dtype: str):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype))

    oracle = hf_logits(hf_at("float32").eval(), ids)
    metrics: dict[str, float] = {"rows": float(len(ids))}
    print(f"last-token logits of {len(ids)} rows ({min(map(len, ids))}-{max(map(len, ids))} tokens) vs fp32 HF")
    print(f"{'system':<22} {'max |logit diff|':>16} {'max |top-1 logprob diff|':>24} {'argmax agree':>12}")
    for dtype in dtypes:
        systems = {f"prefill-runtime {dtype}": ours_logits(path, dtype, ids, members)}
        if dtype != "float32":
            systems[f"transformers {dtype}"] = hf_logits(hf_at(dtype).eval(), ids)
        for name, logits in systems.items():
            row = compare(logits, oracle)
            key = name.replace("prefill-runtime", "ours").replace("transformers", "hf").replace(" ", "_")
            metrics.update({f"{key}.{k}": v for k, v in row.items()})
            print(
                f"{name:<22} {row['max_logit_diff']:>16.4f} {row['max_top1_logprob_diff']:>24.4f} "
                f"{row['argmax_agree']:>12.1%}"
            )
    return metrics


def lm_eval_rows(dtypes: list[str]) -> dict[str, float]:
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    gguf = smollm2_path()
    tasks = TaskManager(include_path=str(REPO / "evals"))
    metrics: dict[str, float] = {}
    print(
        f"\nlm-eval on evals/ (max_length 256, batch 8): {'system':<22} {'prefill_mc acc':>14} {'rolling word ppl':>16}"
    )
    for dtype in dtypes:
        systems = {
            "prefill-runtime": lambda d=dtype: PrefillRuntimeLM(model=str(gguf), max_length=256, batch_size=8, dtype=d),
            "hf": lambda d=dtype: HFLM(
                pretrained=str(gguf.parent), gguf_file=gguf.name, device="cpu", dtype=d, max_length=256, batch_size=8
            ),
        }
        for name, build in systems.items():
            out = evaluator.simple_evaluate(
                model=build(), tasks=["prefill_mc", "prefill_rolling"], task_manager=tasks, batch_size=8
            )["results"]
            acc, ppl = out["prefill_mc"]["acc,none"], out["prefill_rolling"]["word_perplexity,none"]
            metrics.update({f"lm_eval.{name}_{dtype}.mc_acc": acc, f"lm_eval.{name}_{dtype}.rolling_word_ppl": ppl})
            print(f"{'':<44} {name + ' ' + dtype:<22} {acc:>14.3f} {ppl:>16.4f}")
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--no-lm-eval", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.chdir(REPO)  # the task files name their data relative to the repository root
    dtypes = args.dtypes.split(",")
    metrics = logit_rows(dtypes)
    if not args.no_lm_eval:
        metrics.update(lm_eval_rows(dtypes))
    units = {k: ("fraction" if k.endswith("agree") or k.endswith("acc") else "abs") for k in metrics}
    cpu = probe_numerics("cpu").as_dict()
    print(f"\nCPU: {cpu}")
    write_json("dtype_accuracy", metrics, units)


if __name__ == "__main__":
    main()
