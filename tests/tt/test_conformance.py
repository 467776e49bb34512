"""Every ttnn call in ``prefill_shell/tt/`` is one the installed ttnn declares (name, arity, keywords).

The call sites are found by AST, so a new call is checked without listing
it; the signatures come from ttnn's bindings (tests/tt/ttnn_signatures.py).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path

import pytest

from tests.tt.tt_report import note
from tests.tt.ttnn_signatures import call_sites, nonconforming, package_call_sites

CHECKED_TTNN = "0.81.1"
"""The ttnn release these signatures were checked against; another one must be re-checked on purpose."""
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "prefill_shell" / "tt"


def _wheel_exists() -> bool:
    """ttnn 0.81.1 ships wheels for CPython 3.10 and 3.12 on x86_64 Linux only."""
    return sys.platform == "linux" and platform.machine() == "x86_64" and sys.version_info[:2] in ((3, 10), (3, 12))


@pytest.fixture(scope="module")
def pinned_ttnn(ttnn):
    try:
        installed = importlib.metadata.version("ttnn")
    except importlib.metadata.PackageNotFoundError:
        if not _wheel_exists():
            pytest.skip(f"no ttnn wheel for Python {sys.version_info[:2]} on {sys.platform}/{platform.machine()}")
        raise
    if installed != CHECKED_TTNN:
        pytest.fail(
            f"installed ttnn {installed} != the checked {CHECKED_TTNN}: re-run this check against it and "
            "update CHECKED_TTNN",
            pytrace=False,
        )
    return ttnn


def test_every_ttnn_call_site_in_the_tt_package_conforms(pinned_ttnn):
    """No call site names a missing function, an undeclared keyword or a positional count no overload takes."""
    sites = package_call_sites(PACKAGE, ROOT)
    assert len(sites) > 50, f"only {len(sites)} ttnn call sites found: the AST scan lost its receivers"
    problems = nonconforming(pinned_ttnn, sites)
    note(
        f"ttnn {CHECKED_TTNN} signature conformance: {len(sites)} call sites in prefill_shell/tt checked, "
        f"{len(problems)} non-conforming"
    )
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    "call, fragment",
    [
        ("tt.gather(x, 3, index, sparse=True)", "ttnn.gather"),
        ("self.tt.execute_trace(mesh, trace_id, 0, False, True)", "ttnn.execute_trace"),
        ("ttnn.release_trace(mesh)", "ttnn.release_trace"),
        ("tt.deallocate(t, force=False, now=True)", "ttnn.deallocate"),
        ("ttnn.Tensor(array, dtype, None, layout, mapper=None)", "ttnn.Tensor"),
        ("tt.copy_to_device(t)", "does not exist"),
    ],
)
def test_a_nonconforming_call_is_reported_with_its_site(pinned_ttnn, call, fragment):
    """A wrong keyword, arity or name fails the check and names file:line."""
    source = "def f(tt, ttnn, self, x, index, mesh, trace_id, t, array, dtype, layout):\n    " + call + "\n"
    problems = nonconforming(pinned_ttnn, call_sites(source, "example.py"))
    assert len(problems) == 1 and problems[0].startswith("example.py:2:") and fragment in problems[0]


def test_conforming_calls_of_each_binding_kind_pass(pinned_ttnn):
    """A FastOperation overload, a nanobind trace call, ttnn.Tensor and a mesh mapper, each called right."""
    source = (
        "def f(tt, x, index, mesh, trace_id, array, dtype, layout):\n"
        "    tt.gather(x, 3, index)\n    tt.execute_trace(mesh, trace_id, cq_id=0, blocking=False)\n"
        "    tt.Tensor(array, dtype, None, layout, mesh_mapper=None)\n    tt.ShardTensorToMesh(mesh, dim=3)\n"
        "    tt.from_torch(x, dtype=dtype, layout=layout)\n    tt.deallocate(x, force=False)\n"
    )
    sites = call_sites(source, "example.py")
    assert len(sites) == 6 and nonconforming(pinned_ttnn, sites) == []
