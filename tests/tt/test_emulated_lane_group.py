"""A 2-lane group on a 1x2 emulated mesh split into two submeshes equals the torch bfloat16 twin; lanes never mix."""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams, WarmupManifest, route_to_lanes
from prefill_shell.device.contract import SLOTS
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.lanes.group import LaneGroup
from tests.helpers import build_runtime
from tests.tt.emulated_lanes import (
    BLOCK,
    NUM_BLOCKS,
    POLICY,
    assert_logits_close,
    call_args,
    reference_llama,
    torch_executor,
)
from tests.tt.reference_standin import ReferenceLlamaStandIn
from tests.tt.tt_report import note

LENGTHS = [100, 300, 70, 128]
"""Rows 0 and 2 to lane 1 (a wave), rows 1 (chunked: 3 x 128) and 3 to lane 0."""


def _slots(per_lane: int) -> list[int]:
    return [per_lane + 4, 0, per_lane + 9, 7]


def _emulated_lane(emu, submesh) -> PrefillExecutor:
    """``TtnnBackend`` + ``TtModelAdapter`` on one submesh, over its own stand-in model and KV pool."""
    from prefill_shell.tt.adapter import TtModelAdapter
    from prefill_shell.tt.backend import TtnnBackend

    llama = reference_llama()
    kv = llama.new_kv_cache(NUM_BLOCKS, BLOCK)
    standin = ReferenceLlamaStandIn(emu, llama, kv)
    model = TtModelAdapter(standin, llama.spec, mesh_device=submesh, ttnn_module=emu)
    backend = TtnnBackend(submesh, ttnn_module=emu)
    return PrefillExecutor(build_runtime(model, policy=POLICY, backend=backend, kv=kv))


@pytest.fixture
def lanes(ttnn):
    """The emulated group on two 1x1 submeshes of a 1x2 mesh, and the same group on the torch backend."""
    from prefill_shell.tt.emulation import ReferenceEmulation

    emu = ReferenceEmulation(ttnn)
    mesh = emu.open_mesh_device(ttnn.MeshShape(1, 2))
    submeshes = mesh.create_submeshes(ttnn.MeshShape(1, 1))
    assert [s.get_device_ids() for s in submeshes] == [[0], [1]]
    group = LaneGroup([_emulated_lane(emu, s) for s in submeshes])
    yield emu, submeshes, group, LaneGroup([torch_executor(), torch_executor()])
    group.close()
    live = [lane.runtime.backend.ledger.live() for lane in group.lanes]
    note(f"emulated 2-lane group: {emu.replays()} trace replays, {sum(map(len, live))} live tensors after close")
    assert live == [[], []]


def _args(per_lane: int, sampling=None) -> dict:
    args = call_args(LENGTHS, sampling=sampling)
    return {**args, "slots": _slots(per_lane)}


def _warm(group: LaneGroup, args: dict) -> None:
    """Warms each lane with the requests its own rows plan into."""
    routes = route_to_lanes(args["slots"], len(LENGTHS), group.per_lane_batch, group.num_lanes)
    for route in routes:
        rows = list(route.source_rows)
        lane = group.lanes[route.lane]
        sampling = None if args["sampling"] is None else [args["sampling"][r] for r in rows]
        prepared = lane.runtime.prepare(
            args["tokens"][rows],
            args["page_table"][rows],
            [LENGTHS[r] for r in rows],
            None,
            list(route.slots),
            sampling,
        )
        lane.warm_up(WarmupManifest().observe(prepared.requests))


def test_eager_and_traced_group_calls_equal_the_torch_twin(lanes):
    """Both lanes' rows, eager and then traced on their own submesh, match the torch group within bfloat16 tolerance."""
    emu, _, group, twin = lanes
    assert not group.threaded  # in turn: every lane's work is issued before the first readback
    args = _args(group.per_lane_batch)
    want = twin.prefill(**args, mode="eager")
    assert_logits_close("2-lane group, eager", group.prefill(**args, mode="eager"), want)
    _warm(group, args)
    replays = emu.replays()
    assert_logits_close("2-lane group, traced", group.prefill(**args, mode="traced"), want)
    assert emu.replays() == replays + 5  # lane 0: 3 chunks of row 1, then row 3; lane 1: one wave of rows 0, 2
    greedy = _args(group.per_lane_batch, sampling=SamplingParams.greedy())
    _warm(group, greedy)
    tokens = [r.token for r in group.prefill(**greedy, mode="traced")]
    assert tokens == [r.token for r in twin.prefill(**greedy, mode="eager")]


def test_a_tensor_of_one_lanes_submesh_is_refused_on_the_other(lanes):
    """Copying, mixing or replaying across the two submeshes raises ``EmulationError``, as on a device."""
    from prefill_shell.tt.emulation import EmulationError

    emu, submeshes, group, _ = lanes
    first, second = (lane.runtime.backend for lane in group.lanes)
    mine = first.upload(torch.zeros(4, dtype=torch.int64), SLOTS, Ownership.INVOCATION)
    theirs = second.upload(torch.ones(4, dtype=torch.int64), SLOTS, Ownership.INVOCATION)
    with pytest.raises(EmulationError, match="different meshes"):
        second.assign(theirs, mine.value)
    with pytest.raises(EmulationError, match="different meshes"):
        emu.add(mine.value, theirs.value)
    trace = first.capture("k", lambda: emu.add(mine.value, mine.value))
    with pytest.raises(EmulationError, match="different meshes"):
        emu.execute_trace(submeshes[1], trace.payload)
    first.release_trace(trace)
    first.release(mine)
    second.release(theirs)


def test_create_submeshes_tiles_the_mesh_row_major_with_disjoint_devices(ttnn):
    """A 2x4 mesh cut into 1x2 submeshes gives 4 of 2 devices each, row-major; a shape that does not tile raises."""
    from prefill_shell.tt.emulation import EmulationError, ReferenceEmulation

    mesh = ReferenceEmulation(ttnn).open_mesh_device(ttnn.MeshShape(2, 4))
    subs = mesh.create_submeshes(ttnn.MeshShape(1, 2))
    assert [s.get_device_ids() for s in subs] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(s.get_num_devices() == 2 and s.parent is mesh for s in subs)
    with pytest.raises(EmulationError, match="does not tile"):
        mesh.create_submeshes(ttnn.MeshShape(3, 1))


def test_one_lane_over_a_whole_mesh_reads_the_replica_it_names(ttnn):
    """``TtnnBackend(mesh_1x2, replica=1)`` reads device 1's copy of a replicated tensor; replica 2 is refused."""
    from prefill_core.values.errors import PrefillConfigError
    from prefill_shell.tt.backend import TtnnBackend
    from prefill_shell.tt.emulation import ReferenceEmulation

    emu = ReferenceEmulation(ttnn)
    mesh = emu.open_mesh_device(ttnn.MeshShape(1, 2))
    backend = TtnnBackend(mesh, replica=1, ttnn_module=emu)
    handle = backend.upload(torch.tensor([3, 1, 4, 1], dtype=torch.int64), SLOTS, Ownership.INVOCATION)
    assert backend.read([handle])[0].tolist() == [3, 1, 4, 1]
    backend.release(handle)
    with pytest.raises(PrefillConfigError, match="replica=2"):
        TtnnBackend(mesh, replica=2, ttnn_module=emu)
