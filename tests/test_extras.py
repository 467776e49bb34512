"""An optional package that is missing is named with the extra that installs it, and the Pythons it is limited to."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from prefill_core.values.errors import PrefillConfigError
from prefill_shell.extras import LM_EVAL_PYTHONS, TTNN_PYTHONS, MissingExtraError, requires_extra
from prefill_shell.tt.backend import TtnnBackend

RUNNING = f"{sys.version_info[0]}.{sys.version_info[1]}"


def test_the_ttnn_backend_without_ttnn_names_the_shell_extra_and_the_pythons_with_wheels(monkeypatch):
    """Where ``import ttnn`` fails, building a ``TtnnBackend`` raises a ``MissingExtraError`` naming both."""
    monkeypatch.setitem(sys.modules, "ttnn", None)  # what a Python without ttnn's wheel sees
    with pytest.raises(MissingExtraError) as caught:
        TtnnBackend(mesh_device=object())
    message = str(caught.value)
    assert message.startswith("the ttnn backend needs ttnn, which the 'shell' extra installs")
    assert "CPython 3.10 and 3.12" in message
    assert "pip install 'prefill-runtime[shell]'" in message
    assert caught.value.name == "ttnn" and caught.value.extra == "shell"
    assert isinstance(caught.value, PrefillConfigError) and isinstance(caught.value, ModuleNotFoundError)
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_on_a_python_the_extra_skips_the_message_says_which_pythons_have_it():
    """Running outside the extra's Pythons, the error says so and names this interpreter."""
    elsewhere = ("2.7",)
    with pytest.raises(MissingExtraError) as caught, requires_extra("shell", "the ttnn backend", pythons=elsewhere):
        raise ModuleNotFoundError("No module named 'ttnn'", name="ttnn")
    assert str(caught.value) == (
        "the ttnn backend needs ttnn, which the 'shell' extra installs on CPython 2.7 only; "
        f"this is CPython {RUNNING}: pip install 'prefill-runtime[shell]' on one of those"
    )


def test_the_first_missing_extra_is_kept_through_nested_blocks():
    """An inner block's error passes an outer block unchanged: the extra named is the one actually missing."""
    with (
        pytest.raises(MissingExtraError) as caught,
        requires_extra("shell", "outer"),
        requires_extra("testing", "inner"),
    ):
        raise ModuleNotFoundError("No module named 'hypothesis'", name="hypothesis")
    assert caught.value.extra == "testing" and str(caught.value).startswith("inner needs hypothesis")


def test_the_pythons_named_in_code_are_the_markers_of_pyproject():
    """``TTNN_PYTHONS`` and ``LM_EVAL_PYTHONS`` are exactly the ``python_version`` markers their extras carry."""
    tomllib = pytest.importorskip("tomllib")  # 3.11+; the check is static, one Python suffices
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]

    def pythons(line: str) -> tuple[str, ...]:
        return tuple(re.findall(r"python_version == '([0-9.]+)'", line))

    (ttnn,) = (line for line in extras["shell"] if line.startswith("ttnn"))
    assert pythons(ttnn) == TTNN_PYTHONS
    assert {pythons(line) for line in extras["lm-eval"]} == {LM_EVAL_PYTHONS}
