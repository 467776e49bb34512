"""The README's Python blocks run as written, in order, in one namespace (the ttnn block runs in tests/tt)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_shows_python_blocks_and_one_needs_ttnn():
    """The README has its Use blocks and one Tenstorrent block (executed on the emulation by tests/tt)."""
    blocks = _python_blocks()
    assert len(blocks) >= 3
    assert sum("import ttnn" in block for block in blocks) == 1


def test_every_torch_block_runs_as_written(capsys):
    """Each non-ttnn block executes after the ones before it, with nothing defined by the test."""
    namespace: dict = {"__name__": "readme"}
    for number, block in enumerate(_python_blocks()):
        if "import ttnn" in block:
            continue
        exec(compile(block, f"README.md python block {number}", "exec"), namespace)
    assert namespace["tail"].logits.shape == (namespace["model"].spec.vocab_size,)
    assert namespace["runtime"].backend.ledger.live() == []
