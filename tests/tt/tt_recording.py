"""A RECORDING stand-in for the ttnn device layer, for machines without a Tenstorrent device.

``RecordingTtnnDevice`` is passed to ``TtnnBackend(..., ttnn_module=...)`` in
place of the ``ttnn`` module. It never pretends to compute:

* Host API (``from_torch``, ``to_torch``, dtypes, layouts, memory configs,
  and the host-capable ``reshape``, ``typecast``, ``to_layout``,
  ``unsqueeze_to_4D``, ``arange``) is the real ttnn on real host tensors.
* Transfers (``to_device``, ``copy_host_to_device_tensor``, ``from_device``)
  are recorded and hand the real host tensor through; copies check the
  preconditions ttnn documents (same shape, dtype and layout).
* Traces (``begin/end_trace_capture``, ``execute_trace``, ``release_trace``)
  are recorded with their ids; a host write during a capture, a replay of an
  unknown or released trace, and a use of a force-deallocated tensor raise.
* Device ops (``embedding``, ``add``, ``argmax``, ``topk``, ``sampling``,
  ``moreh_logsoftmax``, ``gather``, ``copy``) record the call, check the
  input contract ttnn documents for them, and return ZERO host tensors of the
  documented output shape: placeholders for sequencing, never results.

Any other ``ttnn`` attribute raises, so every device touch is deliberate.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

__all__ = ["Call", "RecordingMesh", "RecordingTtnnDevice", "RecordingModel", "RecordingKV"]

HOST_API = frozenset(
    {
        "from_torch",
        "to_torch",
        "uint32",
        "uint16",
        "int32",
        "bfloat16",
        "float32",
        "ROW_MAJOR_LAYOUT",
        "TILE_LAYOUT",
        "DRAM_MEMORY_CONFIG",
        "L1_MEMORY_CONFIG",
        "Tensor",
        "DataType",
        "Layout",
    }
)
HOST_OPS = ("reshape", "typecast", "to_layout", "unsqueeze_to_4D")
RECORDED = (
    "to_device",
    "from_device",
    "copy_host_to_device_tensor",
    "deallocate",
    "synchronize_device",
    "begin_trace_capture",
    "end_trace_capture",
    "execute_trace",
    "release_trace",
    "ReplicateTensorToMesh",
    "ShardTensorToMesh",
    "ConcatMeshToTensor",
    "get_device_tensors",
    "arange",
    "embedding",
    "add",
    "argmax",
    "topk",
    "sampling",
    "moreh_logsoftmax",
    "gather",
    "copy",
    *HOST_OPS,
)
HOST_WRITES = frozenset({"to_device", "copy_host_to_device_tensor"})


class Call:
    """One recorded device call: its name, tensor specs of its arguments and its keyword names."""

    __slots__ = ("name", "args", "kwargs", "tensors")

    def __init__(self, name: str, args: tuple, kwargs: dict):
        self.name = name
        self.tensors = [a for a in args if _is_tensor(a)]
        self.args = tuple(_describe(a) for a in args)
        self.kwargs = {k: _describe(v) for k, v in kwargs.items()}

    def __repr__(self) -> str:
        return f"{self.name}{self.args}{self.kwargs or ''}"


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "padded_shape") and hasattr(value, "layout")


def _describe(value: Any) -> Any:
    if _is_tensor(value):
        return (tuple(value.shape), str(value.dtype).rsplit(".", 1)[-1], str(value.layout).rsplit(".", 1)[-1])
    return value if isinstance(value, (int, float, str, bool, type(None), tuple)) else type(value).__name__


class RecordingMesh:
    """Stands where a one-chip ``MeshDevice`` would be."""

    def get_num_devices(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "RecordingMesh(1 device)"


class RecordingTtnnDevice:
    """Records every device call the ttnn backend makes and answers it without a device (see module doc)."""

    def __init__(self, ttnn: Any):
        missing = [name for name in (*RECORDED, *HOST_API) if not hasattr(ttnn, name)]
        if missing:
            raise AssertionError(
                f"the real ttnn lacks {missing}: the recording would stand in for calls that do not exist"
            )
        self._tt = ttnn
        self.mesh = RecordingMesh()
        self.calls: list[Call] = []
        self._trace_ids = itertools.count(1)
        self.captured: set[int] = set()
        self.released: set[int] = set()
        self.capturing: int | None = None
        self._freed: list[Any] = []  # force-deallocated tensors (kept alive so ids stay unique)
        self.fail_deallocate = 0  # the next N force deallocations raise

    def __getattr__(self, name: str) -> Any:
        if name in HOST_API:
            return getattr(self._tt, name)
        raise AttributeError(f"RecordingTtnnDevice does not stand in for ttnn.{name}; record it before using it")

    # -- bookkeeping ------------------------------------------------------
    def _record(self, name: str, *args, **kwargs) -> Call:
        for tensor in (a for a in (*args, *kwargs.values()) if _is_tensor(a)):
            if any(tensor is freed for freed in self._freed):
                raise AssertionError(f"ttnn.{name} was called with a deallocated tensor {_describe(tensor)}")
        if name in HOST_WRITES and self.capturing is not None:
            raise AssertionError(
                f"ttnn.{name} during the capture of trace {self.capturing}: host writes are not traced"
            )
        call = Call(name, args, kwargs)
        self.calls.append(call)
        return call

    def names(self, since: int = 0) -> list[str]:
        return [c.name for c in self.calls[since:]]

    def count(self, name: str, since: int = 0) -> int:
        return sum(c.name == name for c in self.calls[since:])

    def _zeros(self, shape, dtype: Any, layout: Any) -> Any:
        torch_dtype = torch.bfloat16 if dtype == self._tt.bfloat16 else torch.float32
        if dtype in (self._tt.uint32, self._tt.int32, self._tt.uint16):
            torch_dtype = torch.int32
        return self._tt.from_torch(torch.zeros(tuple(shape), dtype=torch_dtype), dtype=dtype, layout=layout)

    # -- transfers ----------------------------------------------------------
    def to_device(self, tensor, device, memory_config=None):
        self._record("to_device", tensor, memory_config=memory_config)
        return tensor

    def from_device(self, tensor, blocking=True):
        self._record("from_device", tensor, blocking=blocking)
        return tensor

    def copy_host_to_device_tensor(self, host, device_tensor, cq_id=None):
        self._record("copy_host_to_device_tensor", host, device_tensor)
        if _describe(host) != _describe(device_tensor):
            raise AssertionError(
                f"copy_host_to_device_tensor needs equal specs: {_describe(host)} vs {_describe(device_tensor)}"
            )

    def deallocate(self, tensor, force=True):
        self._record("deallocate", tensor, force=force)
        if force and self.fail_deallocate:
            self.fail_deallocate -= 1
            raise RuntimeError("recorded deallocate failure (injected)")
        if force:
            self._freed.append(tensor)

    def synchronize_device(self, device, cq_id=None):
        self._record("synchronize_device")

    # -- traces -------------------------------------------------------------
    def begin_trace_capture(self, device, cq_id=None):
        if self.capturing is not None:
            raise AssertionError("begin_trace_capture inside another capture")
        trace_id = next(self._trace_ids)
        self._record("begin_trace_capture", trace_id, cq_id=cq_id)
        self.capturing = trace_id
        return trace_id

    def end_trace_capture(self, device, trace_id, cq_id=None):
        self._record("end_trace_capture", trace_id, cq_id=cq_id)
        if self.capturing != trace_id:
            raise AssertionError(f"end_trace_capture({trace_id}) while capturing {self.capturing}")
        self.capturing = None
        self.captured.add(trace_id)

    def execute_trace(self, device, trace_id, cq_id=None, blocking=True):
        self._record("execute_trace", trace_id, cq_id=cq_id, blocking=blocking)
        if trace_id not in self.captured or trace_id in self.released:
            raise AssertionError(f"execute_trace of trace {trace_id}, which is not a live capture")

    def release_trace(self, device, trace_id):
        self._record("release_trace", trace_id)
        if trace_id not in self.captured or trace_id in self.released:
            raise AssertionError(f"release_trace of trace {trace_id}, which is not a live capture")
        self.released.add(trace_id)

    # -- mesh mappers (need a MeshDevice: none here, so host tensors stay plain) --
    def ReplicateTensorToMesh(self, mesh):
        self._record("ReplicateTensorToMesh")

    def ShardTensorToMesh(self, mesh, dim):
        self._record("ShardTensorToMesh", dim)

    def ConcatMeshToTensor(self, mesh, dim):
        self._record("ConcatMeshToTensor", dim)

    def get_device_tensors(self, tensor):
        self._record("get_device_tensors", tensor)
        return [tensor]

    # -- host-capable ops: the real ttnn on host tensors, recorded ------------
    def reshape(self, tensor, shape):
        self._record("reshape", tensor, tuple(shape))
        return self._tt.reshape(tensor, tuple(shape))

    def typecast(self, tensor, dtype):
        self._record("typecast", tensor, str(dtype))
        return self._tt.typecast(tensor, dtype)

    def to_layout(self, tensor, layout):
        self._record("to_layout", tensor, str(layout))
        return self._tt.to_layout(tensor, layout)

    def unsqueeze_to_4D(self, tensor):
        self._record("unsqueeze_to_4D", tensor)
        shape = tuple(tensor.shape)
        return self._tt.reshape(tensor, (1,) * (4 - len(shape)) + shape)

    def arange(self, start, end, step=1, dtype=None, device=None, layout=None):
        self._record("arange", start, end, step)
        return self._tt.arange(start, end, step, dtype=dtype)

    # -- device ops: contract checks and zero placeholders --------------------
    def embedding(self, ids, table, layout=None):
        self._record("embedding", ids, table, layout=str(layout))
        _expect(
            ids.dtype == self._tt.uint32 and ids.layout == self._tt.ROW_MAJOR_LAYOUT, "embedding ids: uint32 ROW_MAJOR"
        )
        return self._zeros((*tuple(ids.shape), table.shape[-1]), table.dtype, layout or self._tt.ROW_MAJOR_LAYOUT)

    def add(self, a, b):
        self._record("add", a, b)
        _expect(tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype, "add: equal shapes and dtypes")
        return self._zeros(a.shape, a.dtype, a.layout)

    def argmax(self, tensor, dim=None, keepdim=False):
        self._record("argmax", tensor, dim=dim)
        _expect(dim in (3, -1) and tensor.layout == self._tt.ROW_MAJOR_LAYOUT, "argmax: last dim of ROW_MAJOR logits")
        return self._zeros(tuple(tensor.shape)[:-1], self._tt.uint32, self._tt.ROW_MAJOR_LAYOUT)

    def topk(self, tensor, k, dim=-1, largest=True, sorted=True):
        self._record("topk", tensor, k, dim=dim)
        _expect(tensor.layout == self._tt.TILE_LAYOUT and k <= tensor.shape[-1], "topk: TILE input, k <= width")
        shape = (*tuple(tensor.shape)[:-1], k)
        return self._zeros(shape, tensor.dtype, self._tt.TILE_LAYOUT), self._zeros(
            shape, self._tt.uint32, self._tt.TILE_LAYOUT
        )

    def sampling(self, values, indices, *, k, p, temp, seed=0):
        self._record("sampling", values, indices, k=k, p=p, temp=temp, seed=seed)
        tt, shape = self._tt, tuple(values.shape)
        users, width = shape[2], shape[3]
        _expect(len(shape) == 4 and shape[:2] == (1, 1) and 1 <= users <= 32, "sampling: values [1, 1, users<=32, W]")
        _expect(values.dtype == tt.bfloat16 and values.layout == tt.TILE_LAYOUT, "sampling: values bfloat16 TILE")
        _expect(width % 32 == 0 and (width // 32) & (width // 32 - 1) == 0, "sampling: W a power-of-2 multiple of 32")
        _expect(
            tuple(indices.shape) == shape and indices.layout == tt.ROW_MAJOR_LAYOUT,
            "sampling: indices like values, ROW_MAJOR",
        )
        _expect(indices.dtype in (tt.uint32, tt.int32), "sampling: indices uint32/int32")
        _expect(k.dtype in (tt.uint32, tt.int32) and tuple(k.shape) == (users,), "sampling: k [users] uint32/int32")
        for name, t in (("p", p), ("temp", temp)):
            _expect(t.dtype == tt.bfloat16 and tuple(t.shape) == (users,), f"sampling: {name} [users] bfloat16")
            _expect(t.layout == tt.ROW_MAJOR_LAYOUT, f"sampling: {name} ROW_MAJOR")
        return self._zeros((1, 1, 1, users), tt.uint32, tt.ROW_MAJOR_LAYOUT)

    def moreh_logsoftmax(self, tensor, dim):
        self._record("moreh_logsoftmax", tensor, dim)
        _expect(tensor.layout == self._tt.TILE_LAYOUT, "moreh_logsoftmax: TILE input")
        return self._zeros(tensor.shape, tensor.dtype, tensor.layout)

    def gather(self, tensor, dim, index):
        self._record("gather", tensor, dim, index)
        tt = self._tt
        _expect(
            index.dtype in (tt.uint32, tt.uint16) and index.layout == tt.TILE_LAYOUT, "gather: index uint32/uint16 TILE"
        )
        _expect(len(index.shape) == len(tensor.shape), "gather: index and input of equal rank")
        return self._zeros(index.shape, tensor.dtype, tt.TILE_LAYOUT)

    def copy(self, source, dest):
        self._record("copy", source, dest)
        _expect(
            _describe(source) == _describe(dest), f"copy: {_describe(source)} into {_describe(dest)} needs equal specs"
        )


def _expect(condition: bool, rule: str) -> None:
    if not condition:
        raise AssertionError(f"ttnn contract broken: {rule}")


class RecordingKV:
    """The KV pool argument: only the geometry the runtime config checks."""

    def __init__(self, block_size: int = 32, num_blocks: int = 64):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layers: list = []


class RecordingModel:
    """A model body that records each call and returns zero host tensors of the contract's shape.

    ``forward_hidden`` -> bfloat16 TILE ``[B, 1, S, H]``; ``lm_head`` -> bfloat16
    TILE ``[1, 1, B, V]`` (what a tt_transformers LM head returns). No compute.
    """

    dtype = torch.bfloat16

    def __init__(self, ttnn: Any, spec):
        self._tt = ttnn
        self.spec = spec
        self.calls: list[tuple[str, dict]] = []

    def forward_hidden(self, tokens, start, fill_table, read_table, kv):
        b, s = int(tokens.shape[-2]), int(tokens.shape[-1])
        self.calls.append(
            (
                "forward_hidden",
                {
                    "tokens": _describe(tokens),
                    "start": _describe(start),
                    "fill_table": _describe(fill_table),
                    "read_table": None if read_table is None else _describe(read_table),
                    "kv": kv,
                },
            )
        )
        zeros = torch.zeros(b, 1, s, self.spec.hidden_size, dtype=torch.bfloat16)
        return self._tt.from_torch(zeros, layout=self._tt.TILE_LAYOUT)

    def lm_head(self, rows):
        self.calls.append(("lm_head", {"rows": _describe(rows)}))
        b = int(rows.shape[-2])
        zeros = torch.zeros(1, 1, b, self.spec.vocab_size, dtype=torch.bfloat16)
        return self._tt.from_torch(zeros, layout=self._tt.TILE_LAYOUT)
