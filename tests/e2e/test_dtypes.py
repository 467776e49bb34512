"""bfloat16 and float16 as first-class dtypes: loaded, run and checked against transformers at the same dtype.

Numerics follow transformers at that dtype: RMSNorm normalises in float32
and rounds before its scale (bit for bit), everything else runs in the model
dtype. The tolerances are bf16's: an 8-bit mantissa rounds each op by up to
2**-8 relative, so logits of O(1) agree to about 0.1, not 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

from prefill_core.values.dtype import DeviceNumerics, resolve_dtype
from prefill_shell.backends.numerics import choose_dtype, probe_numerics, torch_dtype
from prefill_shell.cli.main import main
from prefill_shell.reference import random_llama, save_hf_folder
from prefill_shell.reference.llama_like.llama import _rms_norm
from prefill_shell.reference.loading.text import load_model, model_dtype
from tests.helpers import build_runtime, make_tokens, page_table, token_matrix

transformers = pytest.importorskip("transformers")

LENGTHS = (70, 33, 128)
# Largest |logit diff| to transformers at the same dtype on the tiny preset (logits of O(1)); measured 0.03
# (bfloat16) and 0.004 (float16): each side rounds its own sums, so they differ by a few ulps at the end.
TOLERANCE = {torch.bfloat16: 0.125, torch.float16: 0.02}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_hf_folder(random_llama(0, "tiny"), tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_at_half_precision_is_transformers_bit_for_bit(dtype):
    """Normalised in float32, rounded to the model dtype, then scaled: LlamaRMSNorm's exact bits."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(64, 96, generator=gen)).to(dtype)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=gen))
        assert torch.equal(_rms_norm(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_last_token_logits_match_transformers_at_the_same_dtype(tiny_folder, dtype):
    """Three rows of a batch (packed steps) against LlamaForCausalLM loaded at the same dtype: close, same argmax."""
    model = load_model(str(tiny_folder), dtype=dtype)
    assert model.dtype == dtype and model.new_kv_cache(4, 32).dtype == dtype
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_folder, dtype=dtype).eval()
    rows = [make_tokens(n, seed=n) for n in LENGTHS]
    tokens = token_matrix(rows)
    table = page_table([[4 * i + j for j in range(4)] for i in range(len(rows))])
    results = build_runtime(model, num_blocks=12, block_size=32).prefill(tokens, table, list(LENGTHS))
    with torch.no_grad():
        expected = torch.stack([hf(row[None]).logits[0, -1].float() for row in rows])
    actual = torch.stack([r.logits for r in results])
    assert actual.dtype == torch.float32
    assert (actual - expected).abs().max().item() < TOLERANCE[dtype]
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_auto_loads_a_folder_in_its_stored_dtype_and_native_follows_the_probe(tmp_path, tiny_folder):
    """auto: config.json's dtype (bfloat16 here); a random preset names none (float32); native as the probe says."""
    config = json.loads((tiny_folder / "config.json").read_text())
    folder = tmp_path / "bf16"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    (folder / "model.safetensors").write_bytes((tiny_folder / "model.safetensors").read_bytes())
    assert load_model(str(folder), dtype="auto").dtype == torch.bfloat16
    assert load_model(str(folder)).dtype == torch.float32  # the default stays float32
    assert load_model("random:tiny", dtype="auto").dtype == torch.float32
    assert load_model("random:tiny", dtype="bf16").dtype == torch.bfloat16
    native = model_dtype("random:tiny", "native")
    assert native == resolve_dtype("native", None, probe_numerics("cpu"))
    assert load_model("random:tiny", dtype="native").dtype == torch_dtype(native.dtype)


def test_the_cpu_probe_reports_torchs_own_capability_flags():
    """The facts come from torch: capability string, AMX / AVX-512 BF16 flags, and probe rates where they matter."""
    numerics = probe_numerics("cpu")
    flags = dict(numerics.flags)
    assert numerics.capability == torch.backends.cpu.get_cpu_capability()
    assert flags["amx_tile"] == torch.cpu._is_amx_tile_supported()
    assert flags["avx512_bf16"] == torch.cpu._is_avx512_bf16_supported()
    assert numerics.bf16_matrix == (flags["amx_tile"] or flags["avx512_bf16"])
    rates = dict(numerics.matmul_gflops)
    assert set(rates) == ({"float32", "bfloat16"} if numerics.bf16_matrix else set())
    assert all(rate > 0 for rate in rates.values())
    if not numerics.bf16_matrix:
        assert choose_dtype("native", None).dtype == "float32"


def test_a_cuda_device_without_bf16_runs_native_in_float32():
    """The CUDA branch of native, on values (no device here): bf16 support decides."""
    assert resolve_dtype("native", None, DeviceNumerics("cuda", "old", False)).dtype == "float32"


def test_run_with_dtype_bfloat16_says_which_dtype_it_used(tmp_path, capsys):
    """`run --dtype bfloat16` runs the prompts and prints the resolved dtype and why on stderr."""
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 4 5\n6 7 8\n")
    assert main(["run", "--model", "random:tiny", "--dtype", "bfloat16", "--token-ids", str(ids)]) is None
    out, err = capsys.readouterr()
    assert "[dtype] bfloat16 (as requested)" in err
    assert len([line for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]) == 2
