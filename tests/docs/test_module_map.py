"""docs/design.md's module map is the modules' own docstrings: it lists every module, each by its first line.

The map cannot go stale: a module added, removed or re-described without the
map changing fails here (it once missed ``testing/runtime_builder.py``).
``python tests/docs/test_module_map.py`` prints both tables as they should read.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = {"prefill_core": "`prefill_core` (every module pure):", "prefill_shell": "`prefill_shell`, by subpackage"}
ROW = re.compile(r"^\| `([^`]+\.py)` \| (.*) \|$")


def first_line(path: Path) -> str:
    """The first paragraph of a module's docstring on one line, in Markdown's backticks."""
    doc = (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "`").replace("|", "\\|")  # a table cell


def expected(package: str) -> dict[str, str]:
    """Every module of ``package`` (``__init__`` aside) by its path under the package, with its first line."""
    base = ROOT / package
    return {
        str(path.relative_to(base)): first_line(path)
        for path in sorted(base.rglob("*.py"))
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    }


def documented(package: str) -> dict[str, str]:
    """The rows of ``package``'s table in docs/design.md's module map."""
    lines = DESIGN.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if PACKAGES[package] in line)
    rows = {}
    for line in lines[start + 1 :]:
        if rows and not line.startswith("|"):
            break
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def test_the_module_map_lists_every_module_by_its_docstring():
    """Both tables hold exactly the package's modules, each described by its docstring's first line."""
    for package in PACKAGES:
        assert documented(package) == expected(package), f"run python {Path(__file__).relative_to(ROOT)}"


if __name__ == "__main__":
    for package in PACKAGES:
        print(f"\n{package}:\n\n| module | main responsibility |\n| --- | --- |")
        for module, line in expected(package).items():
            print(f"| `{module}` | {line} |")
