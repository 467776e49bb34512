"""Environment of the ttnn tests: real ttnn host tensors, a one-chip mock cluster, temp HOME and cache.

ttnn reads ``HOME`` (its cache path) when imported and the cluster
descriptor when a host conversion first needs one (tilizing into a new
dtype). Without hardware that descriptor is ``mock_cluster/n150.yaml``,
shipped with the tests. The session fixture ``ttnn`` sets all three before
importing ttnn and restores the environment afterwards, so other test
directories never see them. If ttnn cannot be imported, every test here is
skipped with the import error as the reason.

A real device is assumed only when ``/dev/tenstorrent`` holds a chip or
``PREFILL_TT_DEVICE=1``; then no mock is installed (it would hide the chip).
With the mock installed ttnn reports one available device, so
``GetNumAvailableDevices`` cannot tell a mock from hardware.
"""

from __future__ import annotations

import pytest

from tests.tt.tt_env import MOCK_CLUSTER, hardware_present


@pytest.fixture(scope="session")
def ttnn(tmp_path_factory):
    """The real ``ttnn`` module, imported under the test environment (skips the directory if it cannot be)."""
    home = tmp_path_factory.mktemp("tt_home")
    cache = tmp_path_factory.mktemp("tt_metal_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.setenv("TT_METAL_CACHE", f"{cache}/")  # tt-metal joins paths onto it: trailing slash
        if not hardware_present():
            patch.setenv("TT_METAL_MOCK_CLUSTER_DESC_PATH", str(MOCK_CLUSTER))
        try:
            import ttnn as module
        except Exception as error:
            pytest.skip(f"ttnn could not be imported ({type(error).__name__}: {error}); the ttnn tests need it")
        yield module


@pytest.fixture
def recording(ttnn):
    """A fresh ``RecordingTtnnDevice`` over the real ttnn host API."""
    from tests.tt.tt_recording import RecordingTtnnDevice

    return RecordingTtnnDevice(ttnn)


def pytest_terminal_summary(terminalreporter):
    """Prints what the ttnn tests reported (call sites checked, max differences, replays, live tensors)."""
    from tests.tt.tt_report import LINES

    if LINES:
        terminalreporter.section("ttnn")
        for line in LINES:
            terminalreporter.write_line(line)
