"""``ReferenceEmulation`` enforces the device rules a host run would otherwise hide."""

from __future__ import annotations

import pytest
import torch

from prefill_shell.tt.emulation import EmulationError, ReferenceEmulation


@pytest.fixture
def emu(ttnn):
    return ReferenceEmulation(ttnn)


def _upload(emu, values):
    tt = emu.ttnn
    return emu.to_device(
        tt.from_torch(torch.tensor(values, dtype=torch.int32), dtype=tt.int32, layout=tt.ROW_MAJOR_LAYOUT), emu.mesh
    )


def _refresh(emu, target, values):
    tt = emu.ttnn
    emu.copy_host_to_device_tensor(
        tt.from_torch(torch.tensor(values, dtype=torch.int32), dtype=tt.int32, layout=tt.ROW_MAJOR_LAYOUT), target
    )


def _captured_double(emu):
    """A trace computing out = x + x over an uploaded x; returns (trace id, x, out)."""
    x = _upload(emu, [1, 2, 3])
    trace = emu.begin_trace_capture(emu.mesh, cq_id=0)
    out = emu.add(x, x)
    emu.end_trace_capture(emu.mesh, trace, cq_id=0)
    return trace, x, out


def test_a_replay_recomputes_from_the_refreshed_input(emu):
    """After a refresh, the replay writes the new result into the captured output tensor."""
    trace, x, out = _captured_double(emu)
    _refresh(emu, x, [5, 6, 7])
    emu.execute_trace(emu.mesh, trace, cq_id=0, blocking=True)
    assert emu.to_torch(emu.from_device(out)).tolist() == [10, 12, 14]


def test_replaying_with_an_input_never_refreshed_is_an_error(emu):
    """An uploaded input still holding its capture-time value makes the replay fail."""
    trace, _, _ = _captured_double(emu)
    with pytest.raises(EmulationError, match="never refreshed"):
        emu.execute_trace(emu.mesh, trace, cq_id=0)


def test_reading_a_tensor_a_replay_overwrote_is_an_error(emu):
    """A non-blocking read not converted before the next replay fails; so does one converted before synchronize."""
    trace, x, out = _captured_double(emu)
    _refresh(emu, x, [1, 1, 1])
    emu.execute_trace(emu.mesh, trace, cq_id=0)
    pending = emu.from_device(out, blocking=False)
    with pytest.raises(EmulationError, match="before synchronize_device"):
        emu.to_torch(pending)
    emu.synchronize_device(emu.mesh)
    _refresh(emu, x, [2, 2, 2])
    emu.execute_trace(emu.mesh, trace, cq_id=0)
    with pytest.raises(EmulationError, match="overwritten"):
        emu.to_torch(pending)


def test_host_writes_during_capture_and_use_after_free_are_errors(emu):
    """to_device inside a capture, and an op on a force-deallocated tensor, both raise."""
    x = _upload(emu, [1])
    emu.begin_trace_capture(emu.mesh, cq_id=0)
    with pytest.raises(EmulationError, match="during a trace capture"):
        _upload(emu, [2])
    emu.capturing = None
    emu.deallocate(x)
    with pytest.raises(EmulationError, match="after it was deallocated"):
        emu.add(x, x)


def test_a_swapped_gather_argument_is_refused(emu):
    """gather(logp, index, 3), the dim and index swapped, fails the op's input contract."""
    tt = emu.ttnn
    logp = emu.to_device(tt.from_torch(torch.zeros(1, 1, 32, 64), dtype=tt.float32, layout=tt.TILE_LAYOUT), emu.mesh)
    index = emu.to_device(
        tt.from_torch(torch.zeros(1, 1, 32, 1, dtype=torch.int32), dtype=tt.uint32, layout=tt.TILE_LAYOUT), emu.mesh
    )
    assert tuple(emu.gather(logp, 3, index).shape) == (1, 1, 32, 1)
    with pytest.raises(EmulationError, match="dim must be an int"):
        emu.gather(logp, index, 3)
