"""The wheel test's child: imports every module of an installed copy with an extra's packages refused.

``python -I wheel_imports.py SPEC_JSON`` (isolated: neither the clone nor the
environment's PYTHONPATH is on ``sys.path``) reads ``{"target": ...,
"modules": [...], "preload": [...], "runs": {label: [refused top-level
names]}}`` and prints ``{label: {"imports": {module: null | {"type",
"message", "missing"}}, "files": {module: file}}}``: ``null`` where the import
succeeded, and where each imported module was loaded from.

Each run is a forked child whose meta-path finder refuses the run's names, as
a Python without those packages would. Runs that refuse a ``preload`` name
fork before anything is imported; the rest fork after the preload names are
imported once (torch costs seconds per import), which is safe because no
other run refuses them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import json
import os
import sys

OWN = {"prefill_core", "prefill_shell"}


class Refuse(importlib.abc.MetaPathFinder):
    """Refuses every module under the given top-level names, as if they were not installed."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (refused by the wheel test)", name=fullname)
        return None


def import_all(modules: list[str], refused: set[str]) -> dict:
    """Each module's import outcome with ``refused`` blocked (runs in the forked child)."""
    loaded = sorted(name for name in sys.modules if name.partition(".")[0] in refused)
    if loaded:  # refusing a module already imported would prove nothing
        return {"imports": {"<setup>": {"type": "AssertionError", "message": f"imported: {loaded}", "missing": None}}}
    sys.meta_path.insert(0, Refuse(refused))
    outcome = {}
    for module in modules:
        before = set(sys.modules)
        try:
            importlib.import_module(module)
            outcome[module] = None
        except Exception as exc:  # every failure is reported; the test judges it
            missing = exc.name if isinstance(exc, ImportError) else None
            outcome[module] = {"type": type(exc).__qualname__, "message": str(exc), "missing": missing}
            # Submodules a failed package import had loaded stay in sys.modules; a fresh process has none.
            for name in set(sys.modules) - before:
                if name.partition(".")[0] in OWN:
                    del sys.modules[name]
    files = {module: getattr(sys.modules.get(module), "__file__", None) for module in modules if module in sys.modules}
    return {"imports": outcome, "files": files}


def run_forked(modules: list[str], refused: set[str]) -> dict:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            payload = json.dumps(import_all(modules, refused)).encode()
            with os.fdopen(write_end, "wb") as out:
                out.write(payload)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as result:
        payload = result.read()
    os.waitpid(pid, 0)
    return json.loads(payload)


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["target"])
    preload = set(spec["preload"])
    runs = {label: set(names) for label, names in spec["runs"].items()}
    early = [label for label, refused in runs.items() if refused & preload]
    results = {label: run_forked(spec["modules"], runs[label]) for label in early}
    for name in sorted(preload):
        importlib.import_module(name)
    for label, refused in runs.items():
        if label not in results:
            results[label] = run_forked(spec["modules"], refused)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
