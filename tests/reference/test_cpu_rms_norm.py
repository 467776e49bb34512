"""The RMSNorm kernel (prefill_shell/reference/cpu_kernels/rms_norm.py) against transformers' own LlamaRMSNorm
on the same rows and weight, in float32 and bfloat16."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from prefill_shell.reference.cpu_kernels import library
from prefill_shell.reference.cpu_kernels import rms_norm as norm_module
from prefill_shell.reference.cpu_kernels.rms_norm import NORM_ROWS, rms_norm_rows

pytestmark = pytest.mark.skipif(not library.kernel_dtypes(), reason="the CPU kernels do not run here")

DTYPES = [
    pytest.param(dtype, marks=pytest.mark.skipif(dtype not in library.kernel_dtypes(), reason=f"no {dtype} kernel"))
    for dtype in (torch.float32, torch.bfloat16)
]
ROUNDING = {torch.float32: 2**-21, torch.bfloat16: 2**-6}
"""Relative distance allowed: float32, a few steps (the scale and two products each round); bfloat16, one step,
plus the weight's product rounding again."""


def hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", [(1, 64), (7, 576), (300, 512), (1024, 100), (3, 17)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_rows_equal_transformers_norm(dtype, rows, cols, scale):
    """Rows of any width (a width not a multiple of 16 included) and size: transformers' values, but where the
    mean of squares, summed in another order, moves the scale by its last float32 bit. In bfloat16 that flips
    a rounding now and then (under 1% of values); in float32 it moves values by a float32 step or two."""
    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=gen) * scale).to(dtype)
    weight = torch.randn(cols, generator=gen).to(dtype)
    got, expected = rms_norm_rows(x, weight, 1e-5), hf_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:
        differ = got != expected
        assert differ.float().mean() < 0.01, differ.float().mean()
    torch.testing.assert_close(got.float(), expected.float(), rtol=ROUNDING[dtype], atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_threads(dtype):
    """Rows of a wider tensor (a stride past the width) normalise as the same rows copied out, on one thread
    or several (rows enough to be shared out)."""
    wide = torch.randn(NORM_ROWS * 4 + 5, 300).to(dtype)
    x, weight = wide[:, :256], torch.randn(256).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = rms_norm_rows(x, weight, 1e-6)
        torch.set_num_threads(3)
        shared = rms_norm_rows(x, weight, 1e-6)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)
    assert torch.equal(alone, rms_norm_rows(x.contiguous(), weight, 1e-6))


def test_where_it_does_not_apply_it_is_none():
    """float16 rows, a weight in another dtype, a per-head weight, a weight of another width, 3-d rows or
    rows not unit-strided: None, torch's ops decide."""
    x = torch.randn(4, 64)
    weight = torch.ones(64)
    assert rms_norm_rows(x.half(), weight.half(), 1e-6) is None
    assert rms_norm_rows(x, weight.double(), 1e-6) is None
    assert rms_norm_rows(x, torch.ones(2, 64), 1e-6) is None
    assert rms_norm_rows(x, torch.ones(32), 1e-6) is None
    assert rms_norm_rows(x[None], weight, 1e-6) is None
    assert rms_norm_rows(torch.randn(64, 4).t(), torch.ones(4), 1e-6) is None


@pytest.mark.parametrize(
    "rows, cols, threads",
    [(1, 64, 1), (NORM_ROWS, 4096, 1), (NORM_ROWS + 1, 64, 1), (NORM_ROWS + 1, 2048, 0), (NORM_ROWS * 9, 576, 0)],
)
def test_rows_are_shared_out_from_two_work_items_and_enough_elements(monkeypatch, rows, cols, threads):
    """One chunk of rows, or two holding fewer than SHARED_ELEMENTS, run on the calling thread alone; more on
    torch's threads (0), the call's result the same either way."""
    assert (rows * cols >= library.SHARED_ELEMENTS) == (cols >= 576)  # the cases straddle the floor
    seen = []
    real = norm_module.run_kernel
    monkeypatch.setattr(
        norm_module, "run_kernel", lambda name, kernel, *args: (seen.append(args[-1]), real(name, kernel, *args))
    )
    x, weight = torch.randn(rows, cols), torch.randn(cols)
    got = rms_norm_rows(x, weight, 1e-6)
    assert seen == [threads]
    torch.testing.assert_close(got, hf_norm(x, weight, 1e-6), rtol=ROUNDING[torch.float32], atol=0)


def test_norm_rows_is_the_kernels_chunk():
    """``NORM_ROWS`` (the work item ``threads_for`` counts) is the chunk ``rms_norm.c`` claims, ``ROWS``."""
    source = Path(norm_module.__file__).with_name("rms_norm.c").read_text()
    assert re.search(r"^#define ROWS (\d+)$", source, re.M).group(1) == str(NORM_ROWS)
