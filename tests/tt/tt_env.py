"""Where the ttnn tests run: the shipped mock cluster descriptor and the hardware probe."""

from __future__ import annotations

import glob
import os
from pathlib import Path

MOCK_CLUSTER = Path(__file__).parent / "mock_cluster" / "n150.yaml"
"""One wormhole_b0 chip (an n150): lets host conversions that tilize run without hardware."""


def hardware_present() -> bool:
    """Whether a Tenstorrent chip is attached (``PREFILL_TT_DEVICE=0/1`` overrides the probe)."""
    override = os.environ.get("PREFILL_TT_DEVICE")
    if override is not None:
        return override == "1"
    return bool(glob.glob("/dev/tenstorrent/*"))
