"""Scoring through lm-eval: prefill-runtime vs lm-eval's own hf model, and the memory of a rolling document.

1. The local multiple-choice task (``evals/prefill_mc.yaml``) through
   lm-eval's ``simple_evaluate`` with ``prefill-runtime`` and with ``hf`` on
   the same SmolLM2 GGUF, same ``max_length``, ``batch_size`` and dtype, one
   after the other in this process (models loaded first, not timed), at each
   dtype of ``--dtype`` (default: float32, and bfloat16 where the CPU computes
   it natively; float32 keys bare, others prefixed ``bfloat16.``; the JSON
   names the CPU and each dtype's matmul probe). Positions
   computed are counted in each model body: the runtime's ``forward_hidden``
   (padding included) and ``forward_packed`` (real tokens end to end), and the
   HF model's forward (its padded input ids); so are the rows each LM head
   projects onto the vocabulary (the runtime scores only the continuation
   positions and each row's last token).
   Goal: the runtime at least 2x faster, shared contexts computed once.
   Beside the whole ``simple_evaluate`` call, the seconds inside each model's
   ``_loglikelihood_tokens`` (its batching and model work, lm-eval's request
   building excluded) are reported: ``simple_evaluate`` also spends seconds
   on work neither model does (``add_env_info`` runs ``pip list`` through
   torch's ``collect_env``), the same for both, which pulls the whole-call
   ratio towards 1.
2. The MMLU-shaped local task (``evals/prefill_mmlu.yaml``: a subject
   description and five few-shot examples, ~300 shared tokens, over 100
   documents) through the same ``simple_evaluate`` with ``prefill-runtime`` on
   a 40-block pool (one row fits, a round of ``--batch-size`` rows sharing the
   preamble does not) and with ``hf``, float32: every request's
   log-likelihood within 1e-4 of hf's (``mmlu_max_abs_ll_diff``), every
   is_greedy equal, accuracy equal; the scorer's rounds (prefill calls) and
   their largest row count show the pool, not ``max_rows``, cut them.
3. Peak RSS, each in a fresh process: a 4096-token document scored over
   rolling windows (one window: max_length 4096) vs a 4096-token last-token
   prefill on the same runtime set-up. Goal: under 1.5x.

    python benchmarks/scoring.py [--threads N] [--batch-size N] [--max-length N] [--dtype D,...] [--no-rss]
    python benchmarks/scoring.py --mmlu-only   # row 2 alone; the JSON keeps the other rows of its last run

Needs Python 3.12 (lm-eval) and the pinned model (``make model``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._report import RESULTS, Metric, command_line, report, table, write_json  # noqa: E402
from benchmarks.prefill_throughput import bench_dtypes, key_prefix  # noqa: E402
from prefill_shell.backends.numerics import matmul_gflops, probe_numerics  # noqa: E402
from prefill_shell.reference.loading.smollm2 import smollm2_path  # noqa: E402

DOCUMENT_TOKENS = 4096
MMLU_POOL_BLOCKS = 40
"""prefill-runtime's pool for the MMLU task: one row (about 23 blocks of 16) fits, a round of 8 (about 60) does not."""
MMLU_MAX_LENGTH = 512


def _count_runtime_positions(lm) -> list[int]:
    """Positions the runtime's model body computes: every token of a padded step (padding included) or a packed one."""
    counter = [0]
    model = lm.model
    forward, forward_packed = model.forward_hidden, model.forward_packed

    def counted(tokens, *args, **kwargs):
        counter[0] += tokens.numel()
        return forward(tokens, *args, **kwargs)

    def counted_packed(tokens, *args, **kwargs):
        counter[0] += tokens.numel()
        return forward_packed(tokens, *args, **kwargs)

    model.forward_hidden, model.forward_packed = counted, counted_packed
    return counter


def _count_lm_head_rows(module_or_model, hidden_size: int) -> list[int]:
    """Rows the LM head projects onto the vocabulary (the runtime's ``lm_head`` call or HF's ``lm_head`` module)."""
    counter = [0]
    if isinstance(module_or_model, torch.nn.Module):

        def hook(_module, args):
            counter[0] += args[0].numel() // hidden_size

        module_or_model.register_forward_pre_hook(hook)
        return counter
    head = module_or_model.lm_head

    def counted(rows, *args, **kwargs):
        counter[0] += rows.numel() // hidden_size
        return head(rows, *args, **kwargs)

    module_or_model.lm_head = counted
    return counter


def _time_loglikelihood(lm) -> list[float]:
    """Seconds spent inside ``lm._loglikelihood_tokens`` (both models are lm-eval ``TemplateLM``s)."""
    seconds = [0.0]
    inner = lm._loglikelihood_tokens

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - start

    lm._loglikelihood_tokens = timed
    return seconds


def _count_hf_positions(lm) -> list[int]:
    counter = [0]

    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counter[0] += ids.numel()

    lm.model.register_forward_pre_hook(hook, with_kwargs=True)
    return counter


def compare_with_hf(args: argparse.Namespace, dtype: str = "float32") -> list[Metric]:
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    gguf = smollm2_path()
    ours = PrefillRuntimeLM(model=str(gguf), max_length=args.max_length, batch_size=args.batch_size, dtype=dtype)
    theirs = HFLM(
        pretrained=str(gguf.parent),
        gguf_file=gguf.name,
        device="cpu",
        dtype=dtype,
        max_length=args.max_length,
        batch_size=args.batch_size,
    )
    counters = {"prefill-runtime": _count_runtime_positions(ours), "hf": _count_hf_positions(theirs)}
    hidden = ours.model.spec.hidden_size
    heads = {
        "prefill-runtime": _count_lm_head_rows(ours.model, hidden),
        "hf": _count_lm_head_rows(theirs.model.lm_head, hidden),
    }
    model_seconds = {"prefill-runtime": _time_loglikelihood(ours), "hf": _time_loglikelihood(theirs)}
    tasks = TaskManager(include_path=str(REPO / "evals"))
    seconds, accuracy = {}, {}
    for name, lm in (("prefill-runtime", ours), ("hf", theirs)):
        start = time.perf_counter()
        out = evaluator.simple_evaluate(model=lm, tasks=["prefill_mc"], task_manager=tasks, batch_size=args.batch_size)
        seconds[name] = time.perf_counter() - start
        accuracy[name] = out["results"]["prefill_mc"]["acc,none"]
    speedup = seconds["hf"] / seconds["prefill-runtime"]
    positions = {name: counter[0] for name, counter in counters.items()}
    note = f"acc {accuracy['prefill-runtime']:.3f} vs {accuracy['hf']:.3f}"
    p = key_prefix(dtype)
    probe = matmul_gflops(ours.model.dtype)
    return [
        Metric(f"{p}mc_seconds_prefill_runtime", seconds["prefill-runtime"], "s", note=note),
        Metric(f"{p}mc_seconds_hf", seconds["hf"], "s"),
        Metric(f"{p}mc_hf_over_runtime", speedup, "x", note="goal >= 2"),
        Metric(f"{p}mc_model_seconds_prefill_runtime", model_seconds["prefill-runtime"][0], "s"),
        Metric(f"{p}mc_model_seconds_hf", model_seconds["hf"][0], "s"),
        Metric(
            f"{p}mc_model_hf_over_runtime",
            model_seconds["hf"][0] / model_seconds["prefill-runtime"][0],
            "x",
            note="inside _loglikelihood_tokens",
        ),
        Metric(f"{p}mc_acc_prefill_runtime", accuracy["prefill-runtime"], "fraction"),
        Metric(f"{p}mc_acc_hf", accuracy["hf"], "fraction"),
        Metric(f"{p}mc_positions_prefill_runtime", positions["prefill-runtime"], "positions"),
        Metric(f"{p}mc_positions_hf", positions["hf"], "positions"),
        Metric(f"{p}mc_positions_hf_over_runtime", positions["hf"] / positions["prefill-runtime"], "x"),
        Metric(f"{p}mc_lm_head_rows_prefill_runtime", heads["prefill-runtime"][0], "rows"),
        Metric(f"{p}mc_lm_head_rows_hf", heads["hf"][0], "rows"),
        Metric(f"{p}matmul_probe_gflops", probe, "GFLOP/s", note=f"torch.mm {dtype}, {args.threads} thread(s)"),
    ]


def _mmlu_responses(results) -> list[list[tuple[float, bool]]]:
    """Per document (doc_id order), each choice's (log-likelihood, is_greedy)."""
    samples = sorted(results["samples"]["prefill_mmlu"], key=lambda s: s["doc_id"])
    return [[(float(r[0][0]), bool(r[0][1])) for r in s["resps"]] for s in samples]


def mmlu_with_hf(args: argparse.Namespace) -> list[Metric]:
    """prefill_mmlu on SmolLM2 through lm-eval: prefill-runtime on a pool smaller than a round against hf."""
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    gguf = smollm2_path()
    ours = PrefillRuntimeLM(
        model=str(gguf),
        max_length=MMLU_MAX_LENGTH,
        block_size=16,
        num_blocks=MMLU_POOL_BLOCKS,
        batch_size=args.batch_size,
    )
    rounds, prefill = [], ours.scorer._prefill
    ours.scorer._prefill = lambda tokens, *rest: rounds.append(tokens.shape[0]) or prefill(tokens, *rest)
    theirs = HFLM(
        pretrained=str(gguf.parent),
        gguf_file=gguf.name,
        tokenizer=ours.tokenizer,  # the same GGUF's tokenizer, rebuilt once
        device="cpu",
        dtype="float32",
        max_length=MMLU_MAX_LENGTH,
        batch_size=args.batch_size,
    )
    tasks = TaskManager(include_path=str(REPO / "evals"), include_defaults=False)  # our task alone: a quick index
    seconds, runs = {}, {}
    for name, lm in (("prefill_runtime", ours), ("hf", theirs)):
        start = time.perf_counter()
        runs[name] = evaluator.simple_evaluate(
            model=lm, tasks=["prefill_mmlu"], task_manager=tasks, batch_size=args.batch_size, log_samples=True
        )
        seconds[name] = time.perf_counter() - start
    mine, hf = _mmlu_responses(runs["prefill_runtime"]), _mmlu_responses(runs["hf"])
    if [len(doc) for doc in mine] != [len(doc) for doc in hf]:
        raise SystemExit("prefill_mmlu: the two runs scored different requests")
    pairs = [(a, b) for doc_a, doc_b in zip(mine, hf) for a, b in zip(doc_a, doc_b)]
    worst = max(abs(a[0] - b[0]) for a, b in pairs)
    greedy_differ = sum(a[1] != b[1] for a, b in pairs)
    acc = {name: run["results"]["prefill_mmlu"]["acc,none"] for name, run in runs.items()}
    context = runs["prefill_runtime"]["samples"]["prefill_mmlu"][0]["arguments"][0][0]
    shared = len(ours.tok_encode(context))
    note = f"{len(mine)} docs, {len(pairs)} requests, context {shared} tokens"
    return [
        Metric("mmlu_max_abs_ll_diff", worst, "nats", 1e-4, note),
        Metric("mmlu_greedy_flags_differ", greedy_differ, "requests", None, "must be 0"),
        Metric("mmlu_acc_prefill_runtime", acc["prefill_runtime"], "fraction", note=f"hf {acc['hf']:.3f}"),
        Metric("mmlu_acc_hf", acc["hf"], "fraction"),
        Metric("mmlu_pool_blocks", MMLU_POOL_BLOCKS, "blocks", note=f"free after: {ours.scorer.pool.available}"),
        Metric("mmlu_rounds", len(rounds), "calls", note=f"largest {max(rounds)} rows, max_rows {args.batch_size}"),
        Metric("mmlu_seconds_prefill_runtime", seconds["prefill_runtime"], "s"),
        Metric("mmlu_seconds_hf", seconds["hf"], "s"),
        Metric("mmlu_hf_over_runtime", seconds["hf"] / seconds["prefill_runtime"], "x"),
    ]


def _mmlu_only(args: argparse.Namespace) -> None:
    """Runs the MMLU rows and writes them into scoring.json beside the rows of its last full run."""
    rows = mmlu_with_hf(args)
    print(table(rows))
    path = RESULTS / "scoring.json"
    old = json.loads(path.read_text()) if path.exists() else {"metrics": {}, "units": {}}
    metrics = {**old["metrics"], **{m.key: m.value for m in rows}}
    units = {**old["units"], **{m.key: m.unit for m in rows}}
    # The other rows keep their own run's command, targets and notes; these rows name the rerun.
    notes = {
        **old.get("notes", {}),
        **{m.key: "; ".join(filter(None, (m.note, f"from `{command_line()}`"))) for m in rows},
    }
    write_json(
        "scoring",
        metrics,
        units,
        machine=old.get("machine"),
        targets=old.get("targets"),
        notes=notes,
        command=old.get("command"),
    )
    _check_mmlu(rows)


def _check_mmlu(rows: list[Metric]) -> None:
    values = {m.key: m.value for m in rows}
    if values["mmlu_max_abs_ll_diff"] > 1e-4 or values["mmlu_greedy_flags_differ"]:
        raise SystemExit("prefill_mmlu: prefill-runtime's log-likelihoods differ from hf's")


def _child_rss(kind: str, threads: int) -> float:
    command = [sys.executable, __file__, "--rss-child", kind, "--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_child(kind: str) -> None:
    """Runs one 4096-token job in this fresh process and prints its peak RSS in MiB.

    The peak is reset after the model is loaded (Linux ``clear_refs`` 5), so it is the job's, not the
    load's: loading the GGUF (dequantization) peaks higher than either job.
    """
    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    lm = PrefillRuntimeLM(model=str(smollm2_path()), max_length=DOCUMENT_TOKENS)
    Path("/proc/self/clear_refs").write_text("5")
    tokens = torch.randint(1, lm.model.spec.vocab_size, (DOCUMENT_TOKENS,), generator=torch.Generator().manual_seed(0))
    if kind == "rolling":
        lm.scorer.score_rolling([tokens.tolist()], lm.prefix_token_id)
    else:
        runtime = lm.scorer.runtime
        bs = runtime.config.layout.block_size
        table = torch.arange(DOCUMENT_TOKENS // bs, dtype=torch.int32)[None]
        runtime.prefill(tokens[None], table, [DOCUMENT_TOKENS])
    print(_peak_rss_mib())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared machine)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rss-child", choices=("rolling", "last"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="all", help="comma list of dtypes; all: float32, and bfloat16 where native")
    parser.add_argument("--no-rss", action="store_true", help="skip the rolling-document memory comparison")
    parser.add_argument("--mmlu-only", action="store_true", help="the MMLU rows alone, merged into the last JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(args.rss_child)
        return
    os.chdir(REPO)  # the task files name their data relative to the repository root
    if args.mmlu_only:
        _mmlu_only(args)
        return
    metrics = [m for dtype in bench_dtypes(args.dtype) for m in compare_with_hf(args, dtype)]
    metrics += mmlu_with_hf(args)
    if not args.no_rss:
        rolling, last = _child_rss("rolling", args.threads), _child_rss("last", args.threads)
        metrics += [
            Metric("rss_rolling_4096_mib", rolling, "MiB"),
            Metric("rss_last_token_4096_mib", last, "MiB"),
            Metric("rss_rolling_over_last_token", rolling / last, "x", target=1.5),
        ]
    report("scoring", metrics, machine=probe_numerics("cpu").as_dict())
    _check_mmlu(metrics)


if __name__ == "__main__":
    main()
