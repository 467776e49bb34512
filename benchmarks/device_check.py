"""GPU first contact (run by ``scripts/device-check.sh``): traced vs eager, and ours vs transformers, on CUDA.

Models: the reference "bench" Llama (4 layers, 512 wide) at float32 and
bfloat16, and a random Llama of SmolLM2-135M's shape (``smollm2_shape``: 30
layers, 576 wide, vocab 49152; the GGUF file is too large to travel) at
bfloat16. Cases: 1 x 128, 32 x 128, 4 x 1024, 1 x 4096 (equal lengths, so
transformers runs one unpadded batch, ``logits_to_keep=1``).

Per model and case:

* ``traced_identical``: the traced run (CUDA graphs, captured by a warm-up
  on the observed programs) equals the same padded plan run eagerly, bit for
  bit (``PrefillResult`` equality, logits included);
* ``eager_vs_traced_logit_diff``: our default eager run (packed steps, real
  tokens only) against the traced one;
* ``hf_logit_diff`` / ``hf_argmax_agree``: ours (eager) against
  transformers at the same dtype on the same weights;
* tokens/s of ours eager, ours traced and transformers, interleaved rounds
  (who goes first alternates), medians, ``torch.cuda.synchronize`` around each.

``--dry-run`` runs the same flow on the CPU with the tiny preset and small
cases, so the script's own code is tested where no GPU is.

    python benchmarks/device_check.py [--out DIR] [--dry-run] [--budget-s S]
    python benchmarks/device_check.py --readme DIR/device_check.json   # stored in results/, README regenerated
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import report_readme  # noqa: E402
from prefill_core import PageTableLayout, WarmupManifest, ceil_div  # noqa: E402
from prefill_shell.backends import TorchBackend  # noqa: E402
from prefill_shell.backends.numerics import matmul_gflops, probe_numerics  # noqa: E402
from prefill_shell.engine.config import PrefillRuntimeConfig  # noqa: E402
from prefill_shell.engine.executor import PrefillExecutor  # noqa: E402
from prefill_shell.engine.runtime import PrefillRuntime  # noqa: E402
from prefill_shell.reference import random_llama, save_hf_folder  # noqa: E402

BLOCK = 32
RUNS = (("bench", "float32"), ("bench", "bfloat16"), ("smollm2_shape", "bfloat16"))
CASES = {"1x128": [128], "32x128": [128] * 32, "4x1024": [1024] * 4, "1x4096": [4096]}
DRY_RUNS = (("tiny", "float32"), ("tiny", "bfloat16"))
DRY_CASES = {"1x64": [64], "3x32": [32] * 3}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


class Case:
    """One model and batch on both systems: our runtime (eager and traced) and transformers."""

    def __init__(self, model, hf, lengths: list[int], device: torch.device):
        self.device, self.hf, self.lengths = device, hf, lengths
        blocks = [ceil_div(n, BLOCK) for n in lengths]
        kv = model.new_kv_cache(sum(blocks), BLOCK)
        layout = PageTableLayout(BLOCK, max(blocks), sum(blocks))
        self.runtime = PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(device), kv, layout))
        self.executor = PrefillExecutor(self.runtime)
        gen = torch.Generator().manual_seed(len(lengths) * 7 + max(lengths))
        self.tokens = torch.randint(1, model.spec.vocab_size, (len(lengths), max(lengths)), generator=gen)
        self.table = torch.arange(sum(blocks), dtype=torch.int32).reshape(len(lengths), max(blocks))
        self.call = (self.tokens, self.table, lengths)
        self.hf_tokens = self.tokens.to(device)

    def eager(self):
        return self.executor.prefill(*self.call, mode="eager")

    def traced(self):
        return self.executor.prefill(*self.call, mode="traced")

    def theirs(self):
        with torch.inference_mode():
            return self.hf(self.hf_tokens, use_cache=False, logits_to_keep=1).logits[:, -1].float()

    def check(self) -> dict[str, float]:
        """Correctness first: traced vs the same plan eagerly, eager vs traced, ours vs transformers."""
        padded = self.runtime.prepare(*self.call, mode="traced")
        eager = self.eager()
        self.executor.warm_up(WarmupManifest().observe(padded.requests))
        traced = self.traced()
        same = self.runtime.assemble(self.runtime.invocations(padded, mode="eager"), padded.num_rows) == traced
        ours = torch.stack([r.logits for r in eager])
        theirs = self.theirs().cpu()
        return {
            "traced_identical": float(same),
            "eager_vs_traced_logit_diff": (ours - torch.stack([r.logits for r in traced])).abs().max().item(),
            "hf_logit_diff": (ours - theirs).abs().max().item(),
            "hf_argmax_agree": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        }

    def rates(self, rounds: int, budget_s: float) -> dict[str, float]:
        """Tokens/s medians of interleaved rounds (stops early once ``budget_s`` is spent, after 3 rounds)."""
        systems = {"eager": self.eager, "traced": self.traced, "hf": self.theirs}
        samples: dict[str, list[float]] = {name: [] for name in systems}
        start = time.perf_counter()
        for r in range(rounds):
            order = list(systems.items()) if r % 2 == 0 else list(systems.items())[::-1]
            for name, fn in order:
                samples[name].append(_timed(fn, self.device))
            if r >= 2 and time.perf_counter() - start > budget_s:
                break
        tokens = sum(self.lengths)
        out = {f"{name}_tok_s": tokens / statistics.median(s) for name, s in samples.items()}
        out["traced_over_hf"] = out["traced_tok_s"] / out["hf_tok_s"]
        out["eager_over_hf"] = out["eager_tok_s"] / out["hf_tok_s"]
        out["rounds"] = float(len(samples["hf"]))
        return out

    def close(self) -> None:
        self.executor.close()


def _hf(folder: Path, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()  # .to: an older transformers may ignore dtype=


def environment(device: torch.device) -> dict[str, object]:
    import transformers

    env: dict[str, object] = {"torch": torch.__version__, "transformers": transformers.__version__}
    env["numerics"] = probe_numerics(str(device)).as_dict()
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["bf16_mm_tflops"] = _cuda_mm_tflops(device)
    return env


def _cuda_mm_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.mm(a, b)
    seconds = min(_timed(lambda: torch.mm(a, b), device) for _ in range(5))
    return 2.0 * n**3 / seconds / 1e12


def run(device: torch.device, dry_run: bool, budget_s: float, rounds: int = 15) -> dict:
    """Every model x case; returns ``{"environment", "rows"}``."""
    runs, cases = (DRY_RUNS, DRY_CASES) if dry_run else (RUNS, CASES)
    per_case = budget_s / (len(runs) * len(cases))
    out = {"environment": environment(device), "rows": []}
    if device.type == "cpu":
        out["environment"]["cpu_mm_gflops"] = {d: matmul_gflops(getattr(torch, d)) for d in ("float32", "bfloat16")}
    for preset, dtype in runs:
        model = random_llama(0, preset, device=device, dtype=dtype)
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_folder(model, tmp)
            hf = _hf(Path(tmp), getattr(torch, dtype), device)
        for name, lengths in cases.items():
            case = Case(model, hf, lengths, device)
            row = {"model": preset, "dtype": dtype, "case": name, **case.check()}
            row.update(case.rates(rounds, per_case))
            case.close()
            out["rows"].append(row)
            print(_line(row), flush=True)
        del model, hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


_COLUMNS = (
    ("model", "{}"),
    ("dtype", "{}"),
    ("case", "{}"),
    ("eager_tok_s", "{:,.0f}"),
    ("traced_tok_s", "{:,.0f}"),
    ("hf_tok_s", "{:,.0f}"),
    ("traced_over_hf", "{:.2f}x"),
    ("eager_over_hf", "{:.2f}x"),
    ("traced_identical", "{:.0f}"),
    ("eager_vs_traced_logit_diff", "{:.1e}"),
    ("hf_logit_diff", "{:.1e}"),
    ("hf_argmax_agree", "{:.0%}"),
    ("rounds", "{:.0f}"),
)


def _line(row: dict) -> str:
    return " | ".join(fmt.format(row[key]) for key, fmt in _COLUMNS)


def table(result: dict) -> str:
    """The rows as a Markdown table, headed by the machine they ran on."""
    env = result["environment"]
    numerics = env["numerics"]
    head = f"{numerics['capability']}, torch {env['torch']}, transformers {env['transformers']}"
    if "bf16_mm_tflops" in env:
        head += f", bf16 8192^3 torch.mm {env['bf16_mm_tflops']:.0f} TFLOP/s"
    lines = [head, "", "| " + " | ".join(key for key, _ in _COLUMNS) + " |", "|" + " --- |" * len(_COLUMNS)]
    lines += [f"| {_line(row)} |" for row in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--dry-run", action="store_true", help="the same flow on the CPU, tiny preset, small cases")
    parser.add_argument("--budget-s", type=float, default=90.0, help="seconds of timed rounds, all cases together")
    help_readme = "only store JSON as benchmarks/results/device_check.json and regenerate benchmarks/README.md"
    parser.add_argument("--readme", type=Path, metavar="JSON", help=help_readme)
    args = parser.parse_args(argv)
    if args.readme:
        shutil.copyfile(args.readme, report_readme.RESULTS / report_readme.DEVICE_CHECK_JSON)
        report_readme.main([])
        return
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device_check: no CUDA device (use --dry-run to check the flow on the CPU)")
    print(" | ".join(key for key, _ in _COLUMNS), flush=True)
    result = run(device, args.dry_run, args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "device_check_dry_run" if args.dry_run else "device_check"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    (args.out / f"{name}.md").write_text(table(result) + "\n")
    print(f"\n{table(result)}\n\nwrote {args.out / name}.json and .md")


if __name__ == "__main__":
    main()
