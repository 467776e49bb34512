"""docs/planning.md's Python blocks run as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "planning.md"


def test_every_block_of_the_planning_page_runs(capsys):
    """Each block executes after the ones before it (their asserts are the page's claims)."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) >= 5
    namespace: dict = {"__name__": "planning"}
    for number, block in enumerate(blocks):
        exec(compile(block, f"docs/planning.md python block {number}", "exec"), namespace)
    assert namespace["wave"].padded_batch == 4
