"""The README and every page of docs/ run: Python blocks in order, one namespace per page; ``sh`` blocks as scripts.

A Python block that imports ttnn needs the ttnn module and a model on it:
``tests/tt/test_readme_snippet.py`` runs it on the golden-op emulation. A
shell block is fenced ``sh`` and runs as one bash script from a scratch
folder (``benchmarks/`` and ``evals/`` linked in, ``python`` this
interpreter, the clone on ``PYTHONPATH``), except the lines ``NOT_RUN``
names with the reason. No other shell fence is allowed, so no command can
hide from this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
SHELL_FENCES = {"bash", "shell", "console", "zsh"}
RUN_ELSEWHERE = "import ttnn"
EMULATED_PAGE, EMULATED_SECTION = REPO / "docs" / "tenstorrent.md", "## Running on Tenstorrent hardware"

NOT_RUN = {
    "make demo": "fetches the model and runs SmolLM2 (the demo is `make demo` itself)",
    "make test": "is the whole suite, this test included",
    "make test-core": "builds a venv and runs tests/core, which the suite runs",
    "make fuzz": "minutes of randomized examples (CI's fuzz stage)",
    "make fuzz-core": "minutes of randomized examples (CI's fuzz stage)",
    "make test-tt": "needs a Tenstorrent device",
    "make bench": "every benchmark: minutes, and it rewrites benchmarks/results",
    "make explain": "the same as the `python -m prefill_core plan` line run here",
    "python -m prefill_shell run --prompt": "needs the SmolLM2 file; the block's random:tiny line runs the same CLI, "
    "and tests/e2e/test_smollm2.py prefills this prompt (' Paris')",
    "python -m prefill_shell run --chat": "needs the SmolLM2 file and its chat template",
    "python -m prefill_shell run --model path/to/model.gguf": "names a file the reader has",
    "python -m prefill_shell score": "needs the SmolLM2 file; tests/cli/test_score.py runs score on it",
    "python -m prefill_shell embed": "names a folder the reader has; tests/cli/test_pooling_cli.py runs embed on "
    "folders sentence-transformers wrote",
    "python -m prefill_shell rerank": "names a folder the reader has; tests/cli/test_pooling_cli.py runs rerank",
    "pip install 'prefill-runtime": "installs from a package index; tests/test_extras.py and tests/test_wheel.py check "
    "what each extra installs",
    "HF_DATASETS_OFFLINE=1": "lm-eval on SmolLM2: tests/e2e/test_lm_eval.py runs this line with --limit 4",
}


def blocks(page: Path, languages: set[str]) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang in languages]


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def _skipped(line: str) -> str | None:
    command = line.strip()
    return next((reason for prefix, reason in NOT_RUN.items() if command.startswith(prefix)), None)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_python_block_of_the_page_runs(page, capsys):
    """Each block runs after the ones before it, with nothing defined by the test (its asserts are the claims)."""
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for number, block in enumerate(blocks(page, {"python"})):
        if RUN_ELSEWHERE in block:
            continue
        exec(compile(block, f"{_name(page)} python block {number}", "exec"), namespace)


def _shell_env(bin_dir: Path) -> dict[str, str]:
    bin_dir.mkdir()
    python = bin_dir / "python"  # a script, not a link: a link to a venv's python leaves the venv
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, {"sh"})], ids=_name)
def test_every_runnable_shell_block_of_the_page_runs(page, tmp_path):
    """Each ``sh`` block, minus the lines NOT_RUN names, exits 0 from a scratch folder beside benchmarks/ and evals/."""
    for folder in ("benchmarks", "evals"):
        (tmp_path / folder).symlink_to(REPO / folder)
    env = _shell_env(tmp_path / ".bin")
    for number, block in enumerate(blocks(page, {"sh"})):
        script = "\n".join(line for line in block.splitlines() if _skipped(line) is None)
        if not script.strip():
            continue
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"{_name(page)} sh block {number}:\n{script}\n{done.stdout}\n{done.stderr}"


def test_the_one_ttnn_block_is_the_block_the_emulation_runs():
    """The block skipped here for ttnn is the one tests/tt/test_readme_snippet.py runs: none is skipped unseen."""
    ttnn_blocks = [block for page in PAGES for block in blocks(page, {"python"}) if RUN_ELSEWHERE in block]
    section = EMULATED_PAGE.read_text().split(EMULATED_SECTION, 1)[1].split("\n## ", 1)[0]
    first_python = [body for lang, body in FENCE.findall(section) if lang == "python"][:1]
    assert ttnn_blocks == first_python


def test_every_shell_block_is_fenced_sh():
    """A shell command under another fence would escape the shell test, so none is allowed."""
    stray = [
        (_name(page), lang) for page in PAGES for lang, _ in FENCE.findall(page.read_text()) if lang in SHELL_FENCES
    ]
    assert stray == []


def test_every_line_not_run_is_named_with_its_reason_and_still_shown():
    """Each NOT_RUN prefix matches a line some page shows, so the list of commands not run stays the real one."""
    lines = [line.strip() for page in PAGES for block in blocks(page, {"sh"}) for line in block.splitlines()]
    unused = [prefix for prefix in NOT_RUN if not any(line.startswith(prefix) for line in lines)]
    assert unused == []


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_reaches_a_file_and_heading():
    """A link to a page that moved, or to a heading that was renamed, fails here rather than for a reader."""
    broken = []
    for page in [*PAGES, REPO / "benchmarks" / "README.md"]:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append((_name(page), target))
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append((_name(page), target))
    assert broken == []
