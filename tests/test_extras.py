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


def test_the_ttnn_backend_without_ttnn_names_the_tt_extra_and_the_pythons_with_wheels(monkeypatch):
    """Where ``import ttnn`` fails, building a ``TtnnBackend`` raises a ``MissingExtraError`` naming both."""
    monkeypatch.setitem(sys.modules, "ttnn", None)  # what a Python without ttnn's wheel sees
    with pytest.raises(MissingExtraError) as caught:
        TtnnBackend(mesh_device=object())
    message = str(caught.value)
    assert message.startswith("the ttnn backend needs ttnn, which the 'tt' extra installs")
    assert "CPython 3.10 and 3.12" in message
    assert "pip install 'prefill-runtime[tt]'" in message
    assert caught.value.name == "ttnn" and caught.value.extra == "tt"
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

    (ttnn,) = (line for line in extras["tt"] if line.startswith("ttnn"))
    assert pythons(ttnn) == TTNN_PYTHONS
    assert {pythons(line) for line in extras["lm-eval"]} == {LM_EVAL_PYTHONS}


PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
ENSURE_VENV = Path(__file__).resolve().parents[1] / "scripts" / "ensure-venv.sh"


def _expanded(extras: dict[str, list[str]], extra: str) -> list[str]:
    """An extra's requirement lines with ``prefill-runtime[other]`` expanded, as pip and ensure-venv.sh do."""
    lines = []
    for line in extras[extra]:
        own = re.fullmatch(r"prefill-runtime\[([\w,-]+)\]", line)
        lines += [line] if own is None else [x for other in own.group(1).split(",") for x in _expanded(extras, other)]
    return lines


def _requirements(extra: str):
    tomllib = pytest.importorskip("tomllib")
    packaging = pytest.importorskip("packaging.requirements")
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return [packaging.Requirement(line) for line in _expanded(extras, extra)]


def test_the_shell_extra_brings_torch_without_ttnn_or_a_numpy_pin():
    """``[shell]`` is the torch runtime: torch, numpy (2 allowed), safetensors; no ttnn on any Python."""
    shell = _requirements("shell")
    names = {req.name for req in shell}
    assert {"torch", "numpy", "safetensors"} <= names and "ttnn" not in names
    assert all(req.specifier.contains("2.2.0") for req in shell if req.name == "numpy"), [str(r) for r in shell]


def test_the_tt_extra_brings_the_shell_ttnn_and_the_numpy_ttnn_needs():
    """``[tt]`` is the ttnn backend: every ``shell`` package, ttnn on its Pythons, and numpy < 2."""
    tt = _requirements("tt")
    names = {req.name for req in tt}
    assert {req.name for req in _requirements("shell")} <= names and "ttnn" in names
    assert any(not req.specifier.contains("2.2.0") for req in tt if req.name == "numpy")  # the pins intersect


def test_the_suite_venvs_install_the_ttnn_extra():
    """``make test``'s venvs (ensure-venv.sh 3.12 / 3.10) install ``shell`` and ``tt`` and check ttnn imports."""
    script = ENSURE_VENV.read_text()
    suite = script.split("3.10|3.12)", 1)[1].split(";;", 1)[0]
    (extras,) = re.findall(r'extras="([^"]*)"', suite)
    assert {"shell", "tt"} <= set(extras.split()), extras
    assert "ttnn" in re.search(r"check='([^']*)'", suite).group(1)


def test_the_readme_install_lines_say_what_each_runtime_extra_is_for():
    """The README's install block has a line per extra a user picks, and says the ttnn one is ``tt``."""
    readme = (PYPROJECT.parent / "README.md").read_text()
    block = readme.split("## Install", 1)[1].split("```", 2)[1]
    lines = {re.search(r"prefill-runtime(\[[\w,-]+\])?", line).group(0): line for line in block.splitlines()[1:]}
    assert "ttnn" in lines["prefill-runtime[tt]"] and "ttnn" not in lines["prefill-runtime[shell]"]
    assert "torch" in lines["prefill-runtime[shell]"] and "numpy" in lines["prefill-runtime[shell]"]
