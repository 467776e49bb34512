"""``TtnnBackend``: the backend seam on ttnn, over one Tenstorrent ``MeshDevice``.

How each seam operation maps onto ttnn:

* ``upload``: host staging (``tt/staging.py``: the dtype/layout/shape contract)
  then ``ttnn.to_device`` into DRAM; the handle is registered in the ledger.
* ``refresh``: the same staging, then ``ttnn.copy_host_to_device_tensor``
  into the existing tensor (shape, dtype and layout are checked first: the
  op requires them equal). Allocates nothing, so it is safe between replays.
* ``assign``: conforms the fresh value to the target's layout, shape and
  dtype, then ``ttnn.copy(value, target)``. ``ttnn.assign`` is
  bfloat16-only, ``ttnn.copy`` takes any dtype. The value is consumed: it and
  every conversion are deallocated (``force=False``: a buffer someone else
  still references is left to them).
* ``read``: ``ttnn.from_device(t, blocking=False)`` for every handle, one
  ``ttnn.synchronize_device``, then host conversion. Logits compose across the
  mesh with ``logits_composer`` (vocab-sharded: ``ConcatMeshToTensor(mesh,
  dim=3)``); replicated outputs are read from device ``replica`` (every device holds a copy). Values come
  back in the runtime's host contract: ids int64, values float32, ``[B]`` and
  ``[B, N]`` shapes.
* ``release``: ``ttnn.deallocate`` first, then the ledger retires the
  handle: a failed free leaves it live, so the runtime keeps it as an orphan.
* ``gather_rows``: untilizes ``hidden [B, 1, S, H]`` into a row table
  ``[B*S, H]`` and gathers rows ``b*S + index[b]`` with ``ttnn.embedding``
  (one program keyed on ``B*S``, whatever the per-row positions).
* ``gather_positions``: the same row table, gathered at the step rows
  ``b*S + i`` the prompt log-probs ask for (``[1, 1, P, H]``, at most one
  32-row tile: the LM head's input).
* ``argmax``: ``ttnn.argmax(dim=3)`` on row-major logits (the multi-core path).
* ``sample``: ``ttnn.topk(k=32)`` then ``ttnn.sampling`` with the per-row K,
  P and T device tensors the postprocessor owns (staged as K uint32, P and
  1/T bfloat16; uploaded per invocation when eager, refreshed in place in
  the alias workspace when traced). ``ttnn.sampling`` takes one seed per
  call, so a wave draws from ``seeds[0]`` (``device_seed``: its low 32 bits,
  0 mapped to ``0xFFFFFFFF``, because the kernel does not reseed on 0):
  tokens are reproducible per (wave, seed), not per row as on the torch backend.
* ``logprobs``: ``ttnn.moreh_logsoftmax``, ``ttnn.gather`` at the tokens,
  ``ttnn.topk`` for the top-N table.
* Traces: a warm run of the body outside any capture (it compiles the
  trace's own copy programs: nothing may compile during capture), then
  ``begin_trace_capture(mesh, cq_id=0)`` / body / ``end_trace_capture``;
  replay is ``execute_trace(mesh, id, cq_id=0, blocking=False)``.

Device postprocessing needs full-vocabulary logits on every device: with
``logits_composer`` set (vocab-sharded LM head) they are all-gathered first.

``ttnn`` is imported when a backend is built (or passed in as
``ttnn_module``, which is how the recording tests observe every device call);
nothing on the torch path imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from prefill_core import PrefillPolicy
from prefill_core.values.errors import PrefillConfigError, PrefillStateError
from prefill_shell.device.contract import LOGITS, TEMPERATURE, TOP_K, TOP_P, TensorSpec
from prefill_shell.device.ledger import DeviceTensor, Ownership, ResourceLedger
from prefill_shell.device.notes import add_note
from prefill_shell.tt import staging as ttnn_staging

from ..backends.base import TraceHandle

__all__ = ["TtnnBackend", "device_seed", "host_contract"]

_SEED_MASK = 0xFFFFFFFF

SAMPLING_CANDIDATES = 32
"""Top-k candidates handed to ``ttnn.sampling`` (its k is at most 32, so top-32 loses nothing)."""


def host_contract(spec: TensorSpec, value: torch.Tensor) -> torch.Tensor:
    """A read-back tensor in ``spec``'s host form: its rank, its host dtype (float32 for model-dtype values)."""
    if len(spec.dims) == 1:
        value = value.reshape(-1)
    elif len(spec.dims) == 2:
        value = value.reshape(-1, value.shape[-1])
    else:
        value = value.reshape(value.shape[0], -1, value.shape[-1])
    return value.to(spec.host_dtype or torch.float32)


class TtnnBackend:
    """Device operations of the prefill runtime on one ttnn ``MeshDevice``."""

    name = "ttnn"
    max_device_top_k = ttnn_staging.MAX_DEVICE_TOP_K
    max_sampled_wave = SAMPLING_CANDIDATES  # ttnn.sampling serves at most 32 users per call
    packed_steps = False  # fixed-shape programs and traces: padded waves only
    compiles_programs = True  # a program per shape, built on its first run

    def __init__(self, mesh_device: Any, *, replica: int = 0, logits_composer: Any = None, ttnn_module: Any = None):
        if ttnn_module is None:
            ttnn_module = ttnn_staging.import_ttnn()
        self.tt = ttnn_module
        self.device = mesh_device
        self.ledger = ResourceLedger()
        self.num_devices = int(mesh_device.get_num_devices())
        if not 0 <= replica < self.num_devices:
            raise PrefillConfigError(
                f"TtnnBackend.replica={replica!r} is invalid: the mesh has {self.num_devices} devices"
            )
        self.replica = replica
        self.logits_composer = logits_composer
        self.captures = 0
        self._replicate = self.tt.ReplicateTensorToMesh(mesh_device)
        sharded = logits_composer is not None
        self._logits_mapper = self.tt.ShardTensorToMesh(mesh_device, dim=3) if sharded else self._replicate

    def preferred_policy(self, block_size: int) -> PrefillPolicy:
        """tt-metal's ladder: every padded length is a compiled program and a trace to warm up."""
        return PrefillPolicy()

    # -- memory ---------------------------------------------------------
    def _stage(self, spec: TensorSpec, host: torch.Tensor) -> Any:
        mapper = self._logits_mapper if spec is LOGITS else self._replicate
        return ttnn_staging.stage(spec, host, mapper)

    def upload(self, host: torch.Tensor, spec: TensorSpec, ownership: Ownership) -> DeviceTensor:
        staged = self._stage(spec, host)
        value = self.tt.to_device(staged, self.device, memory_config=self.tt.DRAM_MEMORY_CONFIG)
        return self.ledger.register(value, spec, ownership)

    def refresh(self, host: torch.Tensor, target: DeviceTensor) -> None:
        staged, dest = self._stage(target.spec, host), target.value
        if _spec(staged) != _spec(dest):
            msg = f"refresh of {target.name}: host {_spec(staged)} != device {_spec(dest)} (shape, dtype, layout)"
            raise PrefillStateError(msg)
        self.tt.copy_host_to_device_tensor(staged, dest)

    def adopt(self, value: Any, spec: TensorSpec, ownership: Ownership) -> DeviceTensor:
        return self.ledger.register(value, spec, ownership)

    def read(self, handles: list[DeviceTensor]) -> list[torch.Tensor]:
        pending = [(h.spec, self.tt.from_device(h.value, blocking=False)) for h in handles]
        self.tt.synchronize_device(self.device)
        return [host_contract(spec, self._to_torch(spec, host)) for spec, host in pending]

    def _to_torch(self, spec: TensorSpec, host: Any) -> torch.Tensor:
        if spec is LOGITS and self.logits_composer is not None:
            return self.tt.to_torch(host, mesh_composer=self.logits_composer)
        if self.num_devices > 1:
            host = self.tt.get_device_tensors(host)[self.replica]  # replicated: one copy is the value
        return self.tt.to_torch(host)

    def release(self, handle: DeviceTensor) -> None:
        self.tt.deallocate(handle.value)  # raises before the ledger changes: the handle stays live
        self.ledger.retire(handle)

    def assign(self, target: DeviceTensor, value: Any) -> None:
        dest = target.value
        source, made = self._conform(value, dest)
        self.tt.copy(source, dest)
        if value is not dest:
            self._free(*made, value)

    def _conform(self, value: Any, dest: Any) -> tuple[Any, list]:
        """``value`` in ``dest``'s layout, shape and dtype, plus what the conversion allocated."""
        tt, out, made = self.tt, value, []
        rm, tile = tt.ROW_MAJOR_LAYOUT, tt.TILE_LAYOUT
        if out.layout == tile and dest.layout == rm:
            out = tt.to_layout(out, rm)  # reshape row-major: a view, not a re-tilize
            made.append(out)
        if tuple(out.shape) != tuple(dest.shape):
            out = tt.reshape(out, tuple(dest.shape))
        if out.dtype != dest.dtype:
            out = tt.typecast(out, dest.dtype)
            made.append(out)
        if out.layout != dest.layout:
            out = tt.to_layout(out, dest.layout)
            made.append(out)
        return out, made

    def _free(self, *tensors: Any) -> None:
        for tensor in tensors:
            if tensor is not None:
                self.tt.deallocate(tensor, force=False)

    # -- postprocessing -------------------------------------------------
    def gather_rows(self, hidden: Any, index: Any) -> Any:
        tt = self.tt
        b = _volume(index.shape)
        h = hidden.shape[-1]
        s = _volume(hidden.shape) // (b * h)
        rows = tt.to_layout(hidden, tt.ROW_MAJOR_LAYOUT)  # untilize
        table = tt.reshape(rows, (b * s, h))  # [B*S, H]: row b*S + i is token i of row b
        starts = tt.arange(0, b * s, s, dtype=tt.int32, device=self.device)  # b*S for every row b
        starts = tt.to_layout(tt.reshape(starts, (1, b)), tt.TILE_LAYOUT)
        positions = tt.to_layout(tt.reshape(index, (1, b)), tt.TILE_LAYOUT)
        flat = tt.add(positions, starts)  # int32 [1, B]
        ids = tt.typecast(tt.to_layout(flat, tt.ROW_MAJOR_LAYOUT), tt.uint32)
        gathered = tt.embedding(ids, table, layout=tt.TILE_LAYOUT)  # [1, B, H]
        self._free(ids, flat, positions, starts, rows)
        return tt.reshape(gathered, (1, 1, b, h))

    def gather_positions(self, hidden: Any, index: Any) -> Any:
        tt = self.tt
        p, h = _volume(index.shape), hidden.shape[-1]
        rows = tt.to_layout(hidden, tt.ROW_MAJOR_LAYOUT)  # untilize
        table = tt.reshape(rows, (_volume(hidden.shape) // h, h))  # [B*S, H]
        ids = tt.typecast(tt.reshape(index, (1, p)), tt.uint32)
        gathered = tt.embedding(ids, table, layout=tt.TILE_LAYOUT)  # [1, P, H]
        self._free(ids, rows)
        return tt.reshape(gathered, (1, 1, p, h))

    def _full_vocab(self, logits: Any) -> tuple[Any, list]:
        if self.logits_composer is None:
            return logits, []
        gathered = self.tt.all_gather(logits, dim=3)
        return gathered, [gathered]

    def argmax(self, logits: Any) -> Any:
        tt = self.tt
        full, made = self._full_vocab(logits)
        rows = tt.to_layout(full, tt.ROW_MAJOR_LAYOUT)
        tokens = tt.argmax(rows, dim=3)  # uint32 row-major, one id per row
        self._free(rows, *made)
        return tokens

    def sample(self, logits: Any, inputs: Mapping[TensorSpec, Any], seeds: tuple[int, ...]) -> Any:
        """``inputs[TEMPERATURE]`` is staged as the 1/T ``ttnn.sampling`` reads (``staging.stage_temperature``)."""
        tt = self.tt
        users = logits.shape[-2]
        if users > SAMPLING_CANDIDATES:
            raise PrefillConfigError(f"ttnn.sampling serves at most 32 rows per call; this wave has {users}")
        full, made = self._full_vocab(logits)
        if full.dtype != tt.bfloat16:
            full = tt.typecast(full, tt.bfloat16)  # ttnn.sampling reads bfloat16 TILE values
            made.append(full)
        values, candidates = tt.topk(full, SAMPLING_CANDIDATES, dim=3)  # [1, 1, B, 32]
        indices = tt.typecast(tt.to_layout(candidates, tt.ROW_MAJOR_LAYOUT), tt.uint32)
        k, p, temp = inputs[TOP_K], inputs[TOP_P], inputs[TEMPERATURE]
        tokens = tt.sampling(values, indices, k=k, p=p, temp=temp, seed=device_seed(seeds[0]))
        self._free(indices, candidates, values, *made)
        return tokens

    def logprobs(self, logits: Any, tokens: Any, top_n: int) -> tuple[Any, Any, Any]:
        tt = self.tt
        b = logits.shape[-2]
        full, made = self._full_vocab(logits)
        logp = tt.moreh_logsoftmax(full, 3)  # [1, 1, B, V]
        ids = tt.reshape(tokens, (1, 1, b, 1))
        if ids.dtype != tt.uint32:
            ids = tt.typecast(ids, tt.uint32)
            made.append(ids)
        index = tt.to_layout(ids, tt.TILE_LAYOUT)  # gather reads TILE uint32 indices
        token_logprob = tt.gather(logp, 3, index)  # [1, 1, B, 1]
        top_values = top_ids = None
        if top_n > 0:
            top_values, top_ids = tt.topk(logp, top_n, dim=3)  # [1, 1, B, N]
        self._free(index, logp, *made)
        return token_logprob, top_ids, top_values

    # -- traces ---------------------------------------------------------
    def capture(self, key: str, body: Callable[[], None]) -> TraceHandle:
        tt = self.tt
        body()  # warm run outside the capture: every program the body runs is compiled now
        trace_id = tt.begin_trace_capture(self.device, cq_id=0)
        try:
            body()
        except BaseException as primary:
            _abandon(tt, self.device, trace_id, key, primary)
            raise
        tt.end_trace_capture(self.device, trace_id, cq_id=0)
        self.captures += 1
        return TraceHandle(key, trace_id)

    def replay(self, trace: TraceHandle) -> None:
        if trace.released:
            raise PrefillStateError(f"trace {trace.key} was replayed after it was released")
        self.tt.execute_trace(self.device, trace.payload, cq_id=0, blocking=False)

    def release_trace(self, trace: TraceHandle) -> None:
        if trace.released:
            raise PrefillStateError(f"trace {trace.key} was released twice")
        self.tt.release_trace(self.device, trace.payload)  # a failure leaves the trace releasable
        trace.released = True
        trace.payload = None


def device_seed(seed: int) -> int:
    """The ``ttnn.sampling`` seed for ``seed``: its low 32 bits, never 0.

    The sampling kernel seeds its generator only for a non-zero seed
    (tt-metal ``sampling/device/kernels/compute/sampling.cpp``,
    ``generate_rand_tile``): with 0 it draws from whatever state the core's
    generator holds, so a row with ``seed=0`` would not repeat. 0 becomes
    ``0xFFFFFFFF`` (that one seed and 0 draw alike).
    """
    return int(seed) & _SEED_MASK or _SEED_MASK


def _spec(tensor: Any) -> tuple:
    return tuple(tensor.shape), tensor.dtype, tensor.layout


def _volume(shape: Sequence[int]) -> int:
    out = 1
    for dim in shape:
        out *= int(dim)
    return out


def _abandon(tt: Any, device: Any, trace_id: Any, key: str, primary: BaseException) -> None:
    """Closes and frees a capture whose body failed; cleanup failures ride on ``primary`` as notes."""
    try:
        tt.end_trace_capture(device, trace_id, cq_id=0)
        tt.release_trace(device, trace_id)
    except Exception as failure:
        add_note(primary, f"cleanup: abandoning the capture of trace {key} failed: {failure!r}")
