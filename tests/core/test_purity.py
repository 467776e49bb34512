"""prefill_core stays pure: importing it loads no torch/ttnn/numpy, and its
modules import only the standard library, attrs and cattrs."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "prefill_core"
ALLOWED_THIRD_PARTY = {"attrs", "attr", "cattrs", "cattr"}
FORBIDDEN = ("torch", "ttnn", "numpy", "prefill_shell")


def test_importing_the_core_loads_no_device_or_array_library():
    """A fresh interpreter that imports prefill_core (and plans a batch) gains no torch, ttnn or numpy module."""
    script = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import prefill_core\n"
        "from prefill_core import PageTableLayout, PrefillBatch, PrefillPolicy, PrefillRow\n"
        "from prefill_core import manifest_for, prepare_prefill\n"
        "layout = PageTableLayout(32, 256, 512)\n"
        "batch = PrefillBatch.from_rows((PrefillRow(4097, 0, 0, tuple(range(129))),))\n"
        "prepare_prefill(batch, PrefillPolicy(), layout)\n"
        "manifest_for(PrefillPolicy(), layout)\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO, check=True
    )
    gained = json.loads(result.stdout)
    assert "prefill_core" in gained
    offending = [m for m in gained if m.split(".")[0] in FORBIDDEN]
    assert offending == []


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_core_modules_import_only_stdlib_attrs_and_cattrs():
    """Every absolute import in prefill_core/**/*.py names a stdlib module, attrs, cattrs or prefill_core itself."""
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 10
    allowed = set(sys.stdlib_module_names) | ALLOWED_THIRD_PARTY | {"prefill_core", "__future__"}
    offending = {f.name: sorted(_imported_roots(f) - allowed) for f in files}
    assert {name: mods for name, mods in offending.items() if mods} == {}


def test_core_uses_no_clock_environment_or_io():
    """No core module outside cli/ (the command line) imports time, os, random, datetime or socket (no clocks,
    environment or I/O)."""
    banned = {"time", "os", "random", "datetime", "socket", "subprocess", "threading"}
    modules = [
        f for f in sorted(CORE.rglob("*.py")) if f.name != "__main__.py" and "cli" not in f.relative_to(CORE).parts
    ]
    used = {str(f.relative_to(CORE)): sorted(_imported_roots(f) & banned) for f in modules}
    assert {name: mods for name, mods in used.items() if mods} == {}
