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
