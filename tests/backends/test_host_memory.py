"""backends/host_memory.py: after ``keep_freed_host_memory`` a freed activation's pages serve the next one,
where glibc alone maps (and faults in) fresh pages for every large block."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prefill_shell.backends import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")

CHILD = """
import json, resource, sys, torch
from prefill_shell.backends.host_memory import keep_freed_host_memory
from prefill_shell.backends.torch_backend import TorchBackend
kept = keep_freed_host_memory() if sys.argv[1] == "direct" else (TorchBackend(), keep_freed_host_memory())[1]
for _ in range(2):
    torch.ones(16 << 20)  # 64 MiB, freed at once: the heap settles
faults = []
for _ in range(7):  # the same size again: a step's activations, step after step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": sorted(faults)[3]}))  # the median: the kernel may reclaim a page any time
"""


def child(how: str, **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, how],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_blocks_serve_the_next_step_without_page_faults():
    """64 MiB allocated and freed seven times: the median call takes under a hundred page faults once kept (the
    TorchBackend on the CPU keeps them), thousands where malloc maps fresh pages (PREFILL_HOST_MALLOC=system).
    The median, since the machine's memory reclaim may take back an idle page between two calls."""
    kept = child("backend")
    system = child("direct", **{host_memory.SETTING: "system"})
    assert kept["kept"] is True and system["kept"] is False
    assert kept["faults"] < 100, kept
    assert system["faults"] > 10_000, system  # 16384 pages of 4 KiB per fresh 64 MiB block
