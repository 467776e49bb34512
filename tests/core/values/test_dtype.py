"""prefill_core.values.dtype: a request resolved against the checkpoint and the device's probed numerics."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core.values.dtype import (
    DTYPES,
    NATIVE_BF16_SPEEDUP,
    DeviceNumerics,
    canonical_dtype,
    resolve_dtype,
)
from prefill_core.values.errors import InvalidDtypeError, PrefillConfigError


def _cpu(bf16_matrix: bool, fp32: float | None = 100.0, bf16: float | None = 800.0) -> DeviceNumerics:
    rates = {k: v for k, v in (("float32", fp32), ("bfloat16", bf16)) if v is not None}
    return DeviceNumerics("cpu", "AVX512", bf16_matrix, rates)


@pytest.mark.parametrize(
    "text, name",
    [("bf16", "bfloat16"), ("BFloat16", "bfloat16"), ("torch.float16", "float16"), ("fp32", "float32")]
    + [(" auto ", "auto"), ("NATIVE", "native")],
)
def test_aliases_and_torch_names_are_canonical(text, name):
    """Aliases, torch's ``torch.`` prefix, case and surrounding spaces all name the same request."""
    assert canonical_dtype(text) == name


@pytest.mark.parametrize("text", ["int8", "", "float64", "bf", "half precision"])
def test_an_unknown_request_names_the_field_value_and_the_accepted_names(text):
    """An unknown dtype is an InvalidDtypeError (a PrefillConfigError and ValueError) listing what is accepted."""
    with pytest.raises(InvalidDtypeError, match=r"--dtype=.* is invalid: expected one of float32, bfloat16") as e:
        canonical_dtype(text, "--dtype")
    assert isinstance(e.value, PrefillConfigError) and isinstance(e.value, ValueError)


@given(st.sampled_from(DTYPES), st.sampled_from((None, *DTYPES)), st.booleans())
def test_an_explicit_dtype_is_taken_whatever_the_checkpoint_or_device(dtype, checkpoint, bf16_matrix):
    """float32, bfloat16 and float16 requests resolve to themselves, fast or not."""
    choice = resolve_dtype(dtype, checkpoint, _cpu(bf16_matrix, bf16=1.0))
    assert (choice.dtype, choice.requested) == (dtype, dtype)


def test_auto_is_the_checkpoints_dtype_and_float32_where_it_names_none():
    """auto follows the stored dtype (lm-eval's hf meaning); a GGUF file or random preset names none: float32."""
    assert resolve_dtype("auto", "bfloat16", None).dtype == "bfloat16"
    assert resolve_dtype("auto", "torch.float16", None).dtype == "float16"
    assert resolve_dtype("auto", None, None).dtype == "float32"
    with pytest.raises(InvalidDtypeError, match="checkpoint dtype='int8'"):
        resolve_dtype("auto", "int8", None)


@given(
    st.booleans(),
    st.one_of(st.none(), st.floats(1.0, 5000.0)),
    st.one_of(st.none(), st.floats(1.0, 5000.0)),
)
def test_native_on_a_cpu_picks_bfloat16_only_with_its_instructions_and_a_faster_probe(bf16_matrix, fp32, bf16):
    """bfloat16 exactly when the CPU reports bf16 matrix instructions and both probes ran, bf16 >= 1.5x fp32."""
    choice = resolve_dtype("native", None, _cpu(bf16_matrix, fp32, bf16))
    fast = bf16_matrix and fp32 is not None and bf16 is not None and bf16 >= NATIVE_BF16_SPEEDUP * fp32
    assert choice.dtype == ("bfloat16" if fast else "float32")
    assert choice.requested == "native" and choice.reason


def test_native_reasons_name_what_decided():
    """The printed reason says which fact decided: no instructions, the probe's rates, or a slow probe."""
    assert "neither AMX nor AVX-512 BF16" in resolve_dtype("native", None, _cpu(False)).reason
    assert "800 vs float32 100 GFLOP/s, 8.0x" in resolve_dtype("native", None, _cpu(True)).reason
    assert "under 1.5x" in resolve_dtype("native", None, _cpu(True, 100.0, 120.0)).reason


def test_native_on_cuda_follows_the_devices_bf16_support():
    """A CUDA device with bf16 support runs bfloat16; one without runs float32."""
    assert resolve_dtype("native", None, DeviceNumerics("cuda", "NVIDIA H200", True)).dtype == "bfloat16"
    assert resolve_dtype("native", None, DeviceNumerics("cuda", "Tesla T4", False)).dtype == "float32"


def test_native_without_probed_numerics_is_a_config_error():
    """resolve_dtype never guesses the device: native needs its numerics."""
    with pytest.raises(PrefillConfigError, match="native"):
        resolve_dtype("native", None, None)


def test_numerics_as_dict_names_the_capability_flags_and_rates():
    """The JSON form benchmarks write: capability, flags, matmul rates per dtype."""
    numerics = DeviceNumerics("cpu", "AVX512", True, {"bfloat16": 900.0, "float32": 110.0}, (("amx_tile", True),))
    assert numerics.as_dict() == {
        "device_type": "cpu",
        "capability": "AVX512",
        "bf16_matrix": True,
        "matmul_gflops": {"bfloat16": 900.0, "float32": 110.0},
        "amx_tile": True,
    }
    assert hash(numerics) == hash(DeviceNumerics("cpu", "AVX512", True, numerics.matmul_gflops, numerics.flags))
