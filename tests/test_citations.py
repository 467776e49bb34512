"""What the code and tests cite can be followed: a document inside the repository, upstream code by
repository, path and full commit.

An oracle written from upstream semantics (``tests/tt_transformers_rule.py``) once cited its facts from a
document outside the repository and upstream files by abbreviated commits without a repository.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("prefill_core", "prefill_shell", "tests", "benchmarks", "scripts")
WRITTEN = {"device_check_dry_run.md"}  # a report tests/test_device_check.py has the device check write, not a citation
UPSTREAM_CITERS = ("tests", "benchmarks")  # the oracles written from upstream code, and the like-for-like benchmark
COMMIT = re.compile(r"\b(?:at|commit)\s+\(?(?:commit\s+)?([0-9a-f]{7,40})\b")
REPOSITORY = re.compile(r"\b[\w.-]+/[\w.-]+\b")


def _modules(folders) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_document_the_code_cites_is_in_the_repository():
    """Each markdown document a module names is a file of the repository (by its path's tail)."""
    documents = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md") if ".git" not in p.parts}
    missing = []
    for module in _modules(SOURCES):
        for cited in set(re.findall(r"[\w./-]*\w\.md\b", module.read_text())):
            if cited not in WRITTEN and not any(doc == cited or doc.endswith("/" + cited) for doc in documents):
                missing.append(f"{module.relative_to(ROOT)}: {cited}")
    assert not missing, missing


def test_upstream_code_is_cited_by_repository_path_and_full_commit():
    """Every commit an oracle or benchmark cites is a full 40-digit id, in a module that names the repository."""
    problems = []
    for module in _modules(UPSTREAM_CITERS):
        text = module.read_text()
        for commit in COMMIT.findall(text):
            if len(commit) != 40:
                problems.append(f"{module.relative_to(ROOT)}: abbreviated commit {commit}")
            elif not re.search(r"tenstorrent/[\w.-]+|vllm-project/vllm|huggingface/\w+", text):
                problems.append(f"{module.relative_to(ROOT)}: commit {commit} without its repository")
    assert not problems, problems
