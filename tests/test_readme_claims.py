"""The README's prefix-sharing example and its trust paragraph say what the code does."""

from __future__ import annotations

from pathlib import Path

from prefill_shell.scoring.prefix_sharing import share_prefixes, sharing_groups

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_sharing_example_is_what_the_cli_layout_does():
    """The README's A+x, A+y, B+x, B+y example prefills A once and B once, as the CLI's layout does."""
    assert "A+x, A+y, B+x, B+y prefill A once and B once" in README
    a, b, x, y = [1] * 4, [2] * 4, [3, 4], [5, 6]
    batch = share_prefixes([a + x, a + y, b + x, b + y], 4, sharing_groups([a + x, a + y, b + x, b + y], 4))
    assert batch.prefixes == (tuple(a), tuple(b)) and batch.cached == (4, 4, 4, 4)


def test_readme_states_what_the_runtime_trusts():
    """The README names the trusted prefix, whole token rows, engine-owned page tables and the one-caller rule."""
    section = README.split("**What the runtime trusts.**", 1)[1].split("\n* **", 1)[0]
    for claim in ("Pass whole token rows", "silently changes", "belong to the engine", "one caller at a time"):
        assert claim in " ".join(section.split()), claim
