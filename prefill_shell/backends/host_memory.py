"""Host memory that stays mapped between steps: glibc's malloc told to keep what a step frees for the next.

A prefill step on the CPU allocates its activations afresh: tens of
megabytes per layer at a few thousand tokens. glibc serves each block that
large with its own ``mmap`` and returns it to the kernel when freed, so the
next step touches fresh pages again, one page fault and one zeroed page at a
time. Raising glibc's mmap threshold and trim threshold (``mallopt``) keeps
freed blocks in the heap for the next step instead, as tcmalloc (which
vLLM's CPU docs ask users to preload) does. The cost is that the process
keeps its peak heap: memory a step freed is reused, not returned.

``keep_freed_host_memory`` does this once per process; ``TorchBackend`` calls
it on the CPU. ``PREFILL_HOST_MALLOC=system`` leaves malloc as it is; so does
a C library without ``mallopt`` (not glibc), and an allocator preloaded in
glibc's place answers the call itself.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = ["MMAP_THRESHOLD", "SETTING", "keep_freed_host_memory"]

SETTING = "PREFILL_HOST_MALLOC"
"""``keep`` (default): keep freed blocks for reuse; ``system``: leave malloc's own thresholds."""

MMAP_THRESHOLD = 1 << 30
"""Blocks below this come from the heap and go back to it when freed (glibc's own ceiling is 32 MiB)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_NEVER_TRIM = 2**31 - 1  # the largest value mallopt's int takes


@functools.cache
def keep_freed_host_memory() -> bool:
    """Tells malloc to keep freed blocks (once per process); True where it did."""
    if os.environ.get(SETTING, "keep") == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
