"""Builds ``flash.c`` once per machine and loads it: the CPU attention kernel's shared library.

The library is compiled on first use with the system C compiler (``cc``,
or ``$CC``) for the AVX-512 features the kernel uses, into
``$PREFILL_KERNEL_CACHE`` (default ``~/.cache/prefill-runtime/kernels``)
under a name keyed by the source, the flags and the compiler's version, so
an edited source or another compiler builds anew and concurrent builders
(two test suites) each finish their own file and rename it into place.
Where the CPU lacks AVX-512 (torch's capability below ``AVX512``), where
no compiler runs, or where ``PREFILL_CPU_ATTENTION=torch`` says so, there
is no library and attention stays torch's SDPA.
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

__all__ = ["FlashArgs", "FlashSegment", "SETTING", "kernel_library", "kernel_dtypes"]

SOURCE = Path(__file__).with_name("flash.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma")
BF16_FLAG = "-mavx512bf16"
SETTING = "PREFILL_CPU_ATTENTION"
"""``auto`` (default): the kernel where it builds and the CPU runs it; ``torch``: never the kernel."""


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


@functools.cache
def kernel_dtypes() -> frozenset[torch.dtype]:
    """The dtypes this CPU runs the kernel at: float32 with AVX-512, bfloat16 with AVX512-BF16 too."""
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
    if not SOURCE.exists():
        warnings.warn(f"{SOURCE} is missing: CPU attention stays torch's SDPA", RuntimeWarning, stacklevel=2)
        return None
    if compiler is None:
        warnings.warn("no C compiler: CPU attention stays torch's SDPA", RuntimeWarning, stacklevel=2)
        return None
    flags = (*FLAGS, BF16_FLAG)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        warnings.warn(f"{compiler} --version failed ({err}): CPU attention stays torch's SDPA", RuntimeWarning, 2)
        return None
    key = hashlib.sha256("\0".join((SOURCE.read_text(), *flags, version)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"flash-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            run = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True
            )
            if run.returncode != 0:
                warnings.warn(f"building {SOURCE.name} failed: {run.stderr[-2000:]}", RuntimeWarning, stacklevel=2)
                return None
            os.replace(built, target)
    library = ctypes.CDLL(str(target))
    for name in ("flash_pack", "flash_attend"):
        getattr(library, name).argtypes = [ctypes.POINTER(FlashArgs), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        getattr(library, name).restype = None
    return library


def _cache_dir() -> Path:
    if "PREFILL_KERNEL_CACHE" in os.environ:
        return Path(os.environ["PREFILL_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prefill-runtime" / "kernels"
