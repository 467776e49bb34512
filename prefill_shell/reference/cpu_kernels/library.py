"""Builds the CPU kernels (``flash.c``, ``rms_norm.c``, ``rope.c``, with ``vector_math.h``) once per machine into
one library, and loads it.

The library is compiled on first use with the system C compiler (``cc``,
or ``$CC``) for the AVX-512 features the kernel uses, into
``$PREFILL_KERNEL_CACHE`` (default ``~/.cache/prefill-runtime/kernels``)
under a name keyed by the source, the flags and the compiler's version, so
an edited source or another compiler builds anew and concurrent builders
(two test suites) each finish their own file and rename it into place.
Where the CPU lacks AVX-512 (torch's capability below ``AVX512``), where
no compiler runs, or where ``PREFILL_CPU_KERNELS=torch`` says so, there
is no library and the model keeps torch's ops.

Each kernel splits its work into items that its threads claim from a
shared counter, on OpenMP threads: the library is linked with ``-fopenmp``
and loaded after torch, so the loader hands it the libgomp torch already
loaded and both share one pool of threads. (Kernels run on threads of
their own would compete for the cores with torch's OpenMP workers, which
spin for a while after each op.) An item runs whole on one thread, so the
thread count changes no bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

__all__ = [
    "FlashArgs",
    "FlashSegment",
    "NormArgs",
    "RopeArgs",
    "SETTING",
    "SHARED_ELEMENTS",
    "kernel_dtypes",
    "kernel_library",
    "run_kernel",
    "threads_for",
]

SOURCES = tuple(Path(__file__).with_name(name) for name in ("flash.c", "rms_norm.c", "rope.c"))
HEADERS = (Path(__file__).with_name("vector_math.h"),)
"""Included by the sources: part of the build's key, not of its command line."""
FLAGS = (
    "-O3",
    "-shared",
    "-fPIC",
    "-fopenmp",
    "-std=gnu11",
    "-ffp-contract=off",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mfma",
)
BF16_FLAG = "-mavx512bf16"
SETTING = "PREFILL_CPU_KERNELS"
"""``auto`` (default): the kernels where they build and the CPU runs them; ``torch``: never the kernels."""


class FlashSegment(ctypes.Structure):
    """``flash_segment`` in ``flash.c``."""

    _fields_ = [(name, ctypes.c_int64) for name in ("offset", "length", "start", "blocks_at", "packed_at", "items_at")]


class FlashArgs(ctypes.Structure):
    """``flash_args`` in ``flash.c``."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_st", ctypes.c_int64),
        ("q_sh", ctypes.c_int64),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("k_st", ctypes.c_int64),
        ("k_sh", ctypes.c_int64),
        ("v_st", ctypes.c_int64),
        ("v_sh", ctypes.c_int64),
        ("pool_k", ctypes.c_void_p),
        ("pool_v", ctypes.c_void_p),
        ("bs", ctypes.c_int64),
        ("o", ctypes.c_void_p),
        ("o_st", ctypes.c_int64),
        ("o_sh", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("Hkv", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("bq", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("nseg", ctypes.c_int64),
        ("seg", ctypes.c_void_p),
        ("block_ids", ctypes.c_void_p),
        ("packed", ctypes.c_int64),
        ("items", ctypes.c_int64),
        ("next_pack", ctypes.c_int64),
        ("next_item", ctypes.c_int64),
    ]


class NormArgs(ctypes.Structure):
    """``norm_args`` in ``rms_norm.c``."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("x_stride", ctypes.c_int64),
        ("weight", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("next", ctypes.c_int64),
    ]


class RopeArgs(ctypes.Structure):
    """``rope_args`` in ``rope.c``."""

    _fields_ = [
        ("qk", ctypes.c_void_p),
        ("qk_st", ctypes.c_int64),
        ("v", ctypes.c_void_p),
        ("v_st", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("pool_k", ctypes.c_void_p),
        ("pool_v", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in ("bs", "T", "H", "Hkv", "D", "next")),
    ]


@functools.cache
def kernel_dtypes() -> frozenset[torch.dtype]:
    """The dtypes this CPU runs the kernels at: float32 with AVX-512, bfloat16 with AVX512-BF16 too."""
    if os.environ.get(SETTING, "auto") == "torch":
        return frozenset()
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512",):
        return frozenset()
    if kernel_library() is None:
        return frozenset()
    bf16 = bool(torch.cpu._is_avx512_bf16_supported())
    return frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32})


@functools.cache
def kernel_library() -> ctypes.CDLL | None:
    """The loaded library, built first where needed; None (with a warning) where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    missing = [str(source) for source in (*SOURCES, *HEADERS) if not source.exists()]
    if missing:
        warnings.warn(f"{missing} missing: the model keeps torch's ops", RuntimeWarning, stacklevel=2)
        return None
    if compiler is None:
        warnings.warn("no C compiler: the model keeps torch's ops", RuntimeWarning, stacklevel=2)
        return None
    flags = (*FLAGS, BF16_FLAG)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        warnings.warn(f"{compiler} --version failed ({err}): the model keeps torch's ops", RuntimeWarning, 2)
        return None
    texts = (path.read_text() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256("\0".join((*texts, *flags, version)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                command = [compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"]
                run = subprocess.run(command, capture_output=True, text=True)
                if run.returncode != 0:
                    warnings.warn(f"building the CPU kernels failed: {run.stderr[-2000:]}", RuntimeWarning, 2)
                    return None
                os.replace(built, target)
        library = ctypes.CDLL(str(target))
    except OSError as err:  # an unwritable cache, a library the loader refuses
        warnings.warn(f"the CPU kernels at {target}: {err}; the model keeps torch's ops", RuntimeWarning, 2)
        return None
    pointer, void_p, int_ = ctypes.POINTER, ctypes.c_void_p, ctypes.c_int
    library.flash_run.argtypes = [pointer(FlashArgs), void_p, void_p, int_, int_]
    library.rms_norm_rows.argtypes = [pointer(NormArgs), int_, int_]
    library.rope_write.argtypes = [pointer(RopeArgs), int_, int_]
    for kernel in (library.flash_run, library.rms_norm_rows, library.rope_write):
        kernel.restype = None
    return library


SHARED_ELEMENTS = 1 << 16
"""RMSNorm and rotary calls over fewer elements run on the calling thread: even with torch's workers spinning,
a parallel region costs microseconds, and under this sharing measured a tie at best (``benchmarks/host_forms.py``
rows ``kernel_threads_*`` time calls on either side)."""


def run_kernel(name: str, kernel, *arguments) -> None:
    """``kernel(*arguments)``, named ``name`` in a running ``torch.profiler`` trace (ctypes calls are no torch op,
    so ``benchmarks/_profile.py`` would count them as host work)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            kernel(*arguments)
    else:
        kernel(*arguments)


def threads_for(work_items: int, enough_work: bool) -> int:
    """A kernel call's thread count: torch's (0, OpenMP's default) where it has two work items or more and enough
    work (the caller's floor), else 1 (the calling thread alone, no parallel region).

    The floors are low: the kernels run between a step's GEMMs, while torch's
    OpenMP workers still spin from the last one, so the others join at once.
    """
    return 0 if work_items >= 2 and enough_work else 1


def _cache_dir() -> Path:
    if "PREFILL_KERNEL_CACHE" in os.environ:
        return Path(os.environ["PREFILL_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prefill-runtime" / "kernels"
