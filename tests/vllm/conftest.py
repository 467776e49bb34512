"""Prints the vLLM suite's statistics table (``test_vllm_scheduler.STATS``) at the end of a run."""

from __future__ import annotations

import sys


def pytest_terminal_summary(terminalreporter):
    module = sys.modules.get("tests.vllm.test_vllm_scheduler")
    stats = getattr(module, "STATS", None)
    if not stats:
        return
    write = terminalreporter.write_line
    cols = ["groups", "buffers", "steps", "finished", "prefix_hit_tokens", "window_frees", "stale_at_live_blocks"]
    cols += ["preemptions", "worst_logits", "worst_kv"]
    write("vLLM 0.33 scheduler through the facade:")
    write(" | ".join(["architecture", "workload", "mode", *cols]))
    for (name, workload, mode), row in sorted(stats.items()):
        cells = [f"{row[c]:.2e}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        write(" | ".join([name, workload, mode, *cells]))
