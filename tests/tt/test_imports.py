"""ttnn stays off the torch path: nothing imports it until a ttnn backend or host tensor is asked for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'ttnn')))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_torch_runtime_never_imports_ttnn(ttnn):
    """prefill_core and the whole torch shell load without ttnn."""
    loaded = _modules_after(
        "import prefill_core, prefill_shell.engine.runtime, prefill_shell.engine.executor, prefill_shell.backends"
    )
    assert loaded == set()


def test_the_ttnn_modules_import_ttnn_only_when_used(ttnn):
    """Importing the ttnn backend, its staging and the adapter loads no ttnn; staging a value does."""
    modules = "import prefill_shell.tt.backend, prefill_shell.tt.staging, prefill_shell.tt.adapter"
    assert _modules_after(modules) == set()
    staged = modules + "\nimport torch\nprefill_shell.tt.staging.stage_tokens(torch.ones(1, 4, dtype=torch.int64))"
    assert "ttnn" in _modules_after(staged)
