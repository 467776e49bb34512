"""The core's layer contract holds, and a deliberately broken import fails it (``lint-imports``, as ``make test``).

``pyproject.toml``'s "Core layers" contract orders ``prefill_core``'s
subpackages (cli > tuning | calls > kv_groups > planning > inputs > values).
Here a copy of the core is checked against that contract twice: as it is
(kept), and with ``values/intmath.py`` importing the command line (broken,
and the report names the import).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _core_contract() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'\[\[tool\.importlinter\.contracts\]\]\nname = "Core layers.*?(?=\n\n)', text, re.S)
    assert match, "pyproject.toml has no 'Core layers' import-linter contract"
    return match.group(0)


def _lint(tree: Path) -> subprocess.CompletedProcess:
    config = tree / "layers.toml"
    config.write_text(f'[tool.importlinter]\nroot_packages = ["prefill_core"]\n\n{_core_contract()}\n')
    return subprocess.run(
        [str(LINT), "--config", str(config), "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": str(LINT.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed beside this interpreter")
def test_the_core_layers_hold_and_a_deliberately_broken_import_fails_them(tmp_path):
    """The copy passes; with values/intmath.py importing prefill_core.cli.main it fails, naming that import."""
    shutil.copytree(ROOT / "prefill_core", tmp_path / "prefill_core", ignore=shutil.ignore_patterns("__pycache__"))
    kept = _lint(tmp_path)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    intmath = tmp_path / "prefill_core" / "values" / "intmath.py"
    intmath.write_text(intmath.read_text() + "\nimport prefill_core.cli.main  # noqa: E402,F401 (the broken import)\n")
    broken = _lint(tmp_path)
    assert broken.returncode != 0
    assert "prefill_core.values.intmath -> prefill_core.cli.main" in broken.stdout, broken.stdout
