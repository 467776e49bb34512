"""``ReferenceEmulation``: a one-chip ttnn device EMULATED on the host by ttnn's reference semantics.

This is not the device and not a device simulator. It is what ttnn itself
says each op computes: every op the ttnn backend calls converts its inputs
with ``ttnn.to_torch``, runs the op's ``golden_function`` (ttnn's torch
reference, what tt-metal's own tests compare device output against) and
converts the result with ``ttnn.from_torch`` into the dtype and layout the
op's documentation gives (``emulation_ops.OPS``). The few ops whose goldens
do not compute are the project's own, named as such there.

It lives in the package, not under ``tests/``, so a user can run their own
adapter or model code through ``TtnnBackend(mesh, ttnn_module=emulation)``
on a machine without a Tenstorrent card, with the same checks the test
suite relies on.

Rules it enforces (each broken rule raises ``EmulationError``):

* a tensor passed to an op after a forced ``deallocate``;
* a host write (``to_device``, ``copy_host_to_device_tensor``) or a host
  read during a trace capture; ``copy_host_to_device_tensor`` and ``copy``
  between tensors of different shape, dtype or layout;
* a replay of an unknown or released trace, or a replay while one of the
  trace's host-written inputs was never refreshed since the capture;
* a non-blocking ``from_device`` converted before ``synchronize_device``,
  or after a replay or copy overwrote the tensor it reads;
* an op, copy, capture or replay touching tensors of two meshes (a tensor
  of one submesh used on another, ``emulated_mesh.placement``).

``open_mesh_device(MeshShape(r, c))`` gives a mesh of ``r * c`` emulated
chips and ``create_submeshes`` cuts it into submeshes, one per
data-parallel lane; each tensor lives on the mesh it was placed on.

Traces record every op and model call made between ``begin_trace_capture``
and ``end_trace_capture`` and replay them against the current contents of
the tensors they read; a replay writes the same output tensors again, as a
device trace does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from prefill_shell.tt import emulation_ops

from .emulated_mesh import EmulatedMesh, placement

__all__ = ["EmulatedMesh", "EmulatedTensor", "EmulationError", "HostRead", "ReferenceEmulation"]

_HOST_API = frozenset(
    {
        "uint32",
        "uint16",
        "int32",
        "bfloat16",
        "float32",
        "ROW_MAJOR_LAYOUT",
        "TILE_LAYOUT",
        "DRAM_MEMORY_CONFIG",
        "L1_MEMORY_CONFIG",
        "DataType",
        "Layout",
        "Tensor",
        "from_torch",
        "MeshShape",
    }
)


class EmulationError(AssertionError):
    """A ttnn device rule the emulated call broke (an AssertionError: it is a bug in the caller)."""


class EmulatedTensor:
    """A device tensor of the emulation: a real ttnn host tensor that ops and copies overwrite in place."""

    _ids = itertools.count(1)

    def __init__(self, host: Any, origin: str, mesh: EmulatedMesh):
        self.host = host
        self.mesh = mesh  # where it lives: ops, copies and traces may not mix meshes
        self.origin = origin  # "upload" (a host write made it) or the name of the op that made it
        self.tid = next(self._ids)
        self.version = 0  # bumped by every overwrite: a pending read checks it
        self.host_writes = 0  # uploads and refreshes
        self.freed = False

    @property
    def shape(self):
        return self.host.shape

    @property
    def padded_shape(self):
        return self.host.padded_shape

    @property
    def dtype(self):
        return self.host.dtype

    @property
    def layout(self):
        return self.host.layout

    def overwrite(self, host: Any) -> None:
        self.host = host
        self.version += 1

    def __repr__(self) -> str:
        return f"EmulatedTensor#{self.tid}({tuple(self.shape)}, {self.dtype}, {self.layout}, from {self.origin})"


class HostRead:
    """A non-blocking ``from_device``: valid after the next synchronize, until its source is overwritten."""

    def __init__(self, source: EmulatedTensor, synced: bool):
        self.source = source
        self.version = source.version
        self.host = source.host
        self.synced = synced


class _Trace:
    __slots__ = ("mesh", "records", "inputs", "released", "replays")

    def __init__(self, mesh: EmulatedMesh):
        self.mesh = mesh
        self.records: list[tuple[Callable, tuple, dict, list[EmulatedTensor]]] = []
        self.inputs: dict[int, tuple[EmulatedTensor, int]] = {}  # host-written inputs: writes seen at capture
        self.released = False
        self.replays = 0


def _tensors(values: Sequence[Any]) -> list[EmulatedTensor]:
    out = []
    for value in values:
        if isinstance(value, EmulatedTensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(_tensors(value))
    return out


class _Namespace:
    """``emulation.transformer``: the emulated ops of a ttnn submodule, by their dotted name in ``OPS``."""

    def __init__(self, emulation: ReferenceEmulation, prefix: str):
        self._emulation, self._prefix = emulation, prefix

    def __getattr__(self, name: str) -> Any:
        dotted = f"{self._prefix}.{name}"
        op = emulation_ops.OPS.get(dotted)
        if op is None:
            raise AttributeError(f"ReferenceEmulation does not emulate ttnn.{dotted}")
        return lambda *args, **kwargs: self._emulation.run(dotted, op, args, kwargs)


class ReferenceEmulation:
    """Passed as ``ttnn_module`` to ``TtnnBackend``: the ttnn calls it makes, emulated (see module doc)."""

    def __init__(self, ttnn: Any):
        self.ttnn = ttnn
        self.mesh = EmulatedMesh()
        self._trace_ids = itertools.count(1)
        self.traces: dict[int, _Trace] = {}
        self.capturing: _Trace | None = None
        self.counts: dict[str, int] = {}
        self.live: dict[int, EmulatedTensor] = {}
        self._pending: list[HostRead] = []
        self.fail_deallocate = 0  # the next N forced deallocations raise (fault injection)

    def __getattr__(self, name: str) -> Any:
        if name in _HOST_API:
            return getattr(self.ttnn, name)
        if name == "transformer":  # ttnn.transformer.<op>: emulated under "transformer.<op>"
            return _Namespace(self, name)
        op = emulation_ops.OPS.get(name)
        if op is None:
            raise AttributeError(f"ReferenceEmulation does not emulate ttnn.{name}")
        return lambda *args, **kwargs: self.run(name, op, args, kwargs)

    # -- ops ----------------------------------------------------------------
    def _check_live(self, name: str, args: Sequence[Any]) -> None:
        for tensor in _tensors(args):
            if tensor.freed:
                raise EmulationError(f"ttnn.{name} read {tensor!r} after it was deallocated")

    def run(self, name: str, op: Callable, args: tuple, kwargs: dict) -> Any:
        """Runs ``op`` (host tensors in, host tensors out) and wraps its outputs; records it when capturing."""
        self._check_live(name, (*args, *kwargs.values()))
        device = kwargs.get("device")
        meshes = [t.mesh for t in _tensors((*args, *kwargs.values()))]
        mesh = placement(name, [*meshes, device if isinstance(device, EmulatedMesh) else None], self.mesh)
        if self.capturing is not None:
            placement(name, (mesh, self.capturing.mesh), self.mesh)  # a capture records one mesh's work
        self.counts[name] = self.counts.get(name, 0) + 1
        result = op(self.ttnn, *_unwrap(args), **_unwrap_kw(kwargs))
        outputs = [self._new(host, name, mesh) for host in (result if isinstance(result, tuple) else (result,))]
        if self.capturing is not None:
            self._record(op, args, kwargs, outputs, reads=(*args, *kwargs.values()))
        return tuple(outputs) if isinstance(result, tuple) else outputs[0]

    def host_call(
        self, name: str, fn: Callable[..., torch.Tensor], inputs: Sequence[Any], dtype: Any, layout: Any
    ) -> EmulatedTensor:
        """A model computation on torch values, treated as one device op (recorded and replayed in traces).

        ``fn`` receives ``inputs`` as torch tensors (``None`` stays ``None``;
        integer tensors as int64) and returns one torch tensor, converted to
        ``dtype``/``layout``. For stand-in models that compute on the host.
        """

        def op(tt, *hosts):
            values = [None if h is None else emulation_ops.torch_of(tt, h) for h in hosts]
            return emulation_ops.host_of(tt, fn(*values), dtype, layout)

        return self.run(name, op, tuple(inputs), {})

    def _new(self, host: Any, origin: str, mesh: EmulatedMesh) -> EmulatedTensor:
        tensor = EmulatedTensor(host, origin, mesh)
        self.live[tensor.tid] = tensor
        return tensor

    def _record(
        self, op: Callable | None, args: tuple, kwargs: dict, outputs: list[EmulatedTensor], reads: Sequence[Any]
    ) -> None:
        trace = self.capturing
        made = {t.tid for _, _, _, outs in trace.records for t in outs}
        for tensor in _tensors(reads):
            if tensor.origin == "upload" and tensor.tid not in made and tensor.tid not in trace.inputs:
                trace.inputs[tensor.tid] = (tensor, tensor.host_writes)
        trace.records.append((op, args, kwargs, outputs))

    # -- transfers ----------------------------------------------------------
    def to_device(self, tensor: Any, device: Any = None, memory_config: Any = None) -> EmulatedTensor:
        self._no_capture("to_device")
        self.counts["to_device"] = self.counts.get("to_device", 0) + 1
        out = self._new(tensor, "upload", device if isinstance(device, EmulatedMesh) else self.mesh)
        out.host_writes = 1
        return out

    def copy_host_to_device_tensor(self, host_tensor: Any, device_tensor: EmulatedTensor, cq_id: Any = None) -> None:
        self._no_capture("copy_host_to_device_tensor")
        self._check_live("copy_host_to_device_tensor", (device_tensor,))
        emulation_ops.require_same_spec("copy_host_to_device_tensor", host_tensor, device_tensor.host)
        device_tensor.overwrite(host_tensor)
        device_tensor.host_writes += 1

    def copy(self, input_a: EmulatedTensor, input_b: EmulatedTensor) -> None:
        """ttnn.copy, the project's own: its golden writes nothing. Overwrites ``input_b`` with ``input_a``."""
        self._check_live("copy", (input_a, input_b))
        placement("copy", (input_a.mesh, input_b.mesh), self.mesh)
        emulation_ops.require_same_spec("copy", input_a.host, input_b.host)
        self.counts["copy"] = self.counts.get("copy", 0) + 1
        input_b.overwrite(input_a.host)
        if self.capturing is not None:
            self._record(None, (input_a, input_b), {}, [input_b], reads=(input_a,))

    def from_device(self, tensor: EmulatedTensor, blocking: bool = True, queue_id: Any = None) -> HostRead:
        self._no_capture("from_device")
        self._check_live("from_device", (tensor,))
        read = HostRead(tensor, synced=blocking)
        if not blocking:
            self._pending.append(read)
        return read

    def to_torch(self, tensor: Any, dtype: Any = None, *, mesh_composer: Any = None, **_: Any) -> torch.Tensor:
        if isinstance(tensor, EmulatedTensor):
            raise EmulationError(f"ttnn.to_torch of device tensor {tensor!r}: read it with from_device first")
        if isinstance(tensor, HostRead):
            if not tensor.synced:
                raise EmulationError(
                    f"{tensor.source!r} was read without blocking and converted before synchronize_device"
                )
            if tensor.source.version != tensor.version:
                raise EmulationError(f"{tensor.source!r} was overwritten (a replay or copy) before its read completed")
            tensor = tensor.host
        return self.ttnn.to_torch(tensor, dtype) if dtype is not None else self.ttnn.to_torch(tensor)

    def synchronize_device(self, device: Any, cq_id: Any = None, sub_device_ids: Any = ()) -> None:
        for read in self._pending:
            read.synced = True
        self._pending.clear()

    def deallocate(self, tensor: EmulatedTensor, force: bool = True) -> None:
        if force and self.fail_deallocate:
            self.fail_deallocate -= 1
            raise RuntimeError("emulated deallocate failure (injected)")
        if force:
            tensor.freed = True
            self.live.pop(tensor.tid, None)

    def _no_capture(self, name: str) -> None:
        if self.capturing is not None:
            raise EmulationError(f"ttnn.{name} during a trace capture: host transfers are not traced")

    # -- mesh (replication is the identity: every device holds the same copy) --
    def open_mesh_device(self, mesh_shape: Any = None, **options: Any) -> EmulatedMesh:
        """The emulated chip (a 1x1 shape or none), else a mesh of ``mesh_shape`` emulated chips."""
        if mesh_shape is None or tuple(int(d) for d in mesh_shape) == (1, 1):
            return self.mesh
        return EmulatedMesh(mesh_shape)

    def get_device_tensors(self, tensor: HostRead) -> list[HostRead]:
        """One copy per device of the tensor's mesh (replicated: each is the value)."""
        return [tensor] * tensor.source.mesh.get_num_devices()

    def ReplicateTensorToMesh(self, mesh_device: Any) -> None:
        return None

    def ShardTensorToMesh(self, mesh_device: Any, dim: int) -> None:
        raise EmulationError("the emulation is one chip: vocab-sharded logits need a multi-device mesh")

    # -- traces ---------------------------------------------------------------
    def begin_trace_capture(self, mesh_device: Any, *, cq_id: int = 0) -> int:
        if self.capturing is not None:
            raise EmulationError("begin_trace_capture inside another capture")
        trace_id = next(self._trace_ids)
        self.traces[trace_id] = self.capturing = _Trace(mesh_device)
        return trace_id

    def end_trace_capture(self, mesh_device: Any, trace_id: int, *, cq_id: int = 0) -> None:
        if self.capturing is None or self.traces.get(trace_id) is not self.capturing:
            raise EmulationError(f"end_trace_capture({trace_id}) without its begin_trace_capture")
        self.capturing = None

    def execute_trace(self, mesh_device: Any, trace_id: int, *, cq_id: int = 0, blocking: bool = True) -> None:
        trace = self._live_trace("execute_trace", trace_id)
        placement("execute_trace", (trace.mesh, mesh_device), self.mesh)  # a trace replays on its own mesh
        for tensor, writes_at_capture in trace.inputs.values():
            if tensor.freed:
                raise EmulationError(f"replay of trace {trace_id} reads {tensor!r}, which was deallocated")
            if tensor.host_writes <= writes_at_capture:
                raise EmulationError(
                    f"replay of trace {trace_id}: input {tensor!r} was never refreshed since the capture"
                )
        for op, args, kwargs, outputs in trace.records:
            if op is None:  # a recorded copy: args are (source, destination)
                args[1].overwrite(args[0].host)
                continue
            result = op(self.ttnn, *_unwrap(args), **_unwrap_kw(kwargs))
            for tensor, host in zip(outputs, result if isinstance(result, tuple) else (result,)):
                tensor.overwrite(host)
        trace.replays += 1
        self.counts["execute_trace"] = self.counts.get("execute_trace", 0) + 1

    def release_trace(self, mesh_device: Any, trace_id: int) -> None:
        self._live_trace("release_trace", trace_id).released = True

    def _live_trace(self, name: str, trace_id: int) -> _Trace:
        trace = self.traces.get(trace_id)
        if trace is None or trace.released or trace is self.capturing:
            raise EmulationError(f"{name} of trace {trace_id}, which is not a completed, live capture")
        return trace

    def replays(self) -> int:
        """Replays over every trace so far."""
        return sum(t.replays for t in self.traces.values())


def _unwrap(values: Sequence[Any]) -> tuple:
    return tuple(_unwrap_one(v) for v in values)


def _unwrap_kw(values: dict) -> dict:
    return {k: _unwrap_one(v) for k, v in values.items()}


def _unwrap_one(value: Any) -> Any:
    if isinstance(value, EmulatedTensor):
        return value.host
    if isinstance(value, list):
        return [_unwrap_one(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_unwrap_one(v) for v in value)
    return value
