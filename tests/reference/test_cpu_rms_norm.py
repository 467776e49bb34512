"""The bfloat16 RMSNorm kernel (prefill_shell/reference/cpu_kernels/rms_norm.py) against transformers' own
LlamaRMSNorm on the same rows and weight."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from prefill_shell.reference.cpu_kernels import library
from prefill_shell.reference.cpu_kernels.library import SHARED_ELEMENTS
from prefill_shell.reference.cpu_kernels.rms_norm import rms_norm_rows

pytestmark = pytest.mark.skipif(torch.bfloat16 not in library.kernel_dtypes(), reason="no AVX512-BF16 here")


def hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("rows, cols", [(1, 64), (7, 576), (300, 512), (1024, 100), (3, 17)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_rows_equal_transformers_norm(rows, cols, scale):
    """Rows of any width (a width not a multiple of 16 included) and size: transformers' bits, but where the
    mean of squares, summed in another order, moves the scale by its last float32 bit and a rounding flips."""
    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=gen) * scale).to(torch.bfloat16)
    weight = torch.randn(cols, generator=gen).to(torch.bfloat16)
    got, expected = rms_norm_rows(x, weight, 1e-5), hf_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    differ = got != expected
    assert differ.float().mean() < 0.01, differ.float().mean()
    # a flipped rounding of the normalised value moves it by one bfloat16 step; the weight's product rounds again
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=0)


def test_strided_rows_and_threads():
    """Rows of a wider tensor (a stride past the width) normalise as the same rows copied out, on one thread
    or several (rows enough to be shared out)."""
    wide = torch.randn(SHARED_ELEMENTS // 64, 300).to(torch.bfloat16)
    x, weight = wide[:, :256], torch.randn(256).to(torch.bfloat16)
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
    """float32 rows, a per-head weight, a weight of another width or 3-d rows: None, torch's ops decide."""
    x = torch.randn(4, 64).to(torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    assert rms_norm_rows(x.float(), weight.float(), 1e-6) is None
    assert rms_norm_rows(x, torch.ones(2, 64, dtype=torch.bfloat16), 1e-6) is None
    assert rms_norm_rows(x, torch.ones(32, dtype=torch.bfloat16), 1e-6) is None
    assert rms_norm_rows(x[None], weight, 1e-6) is None
