"""``TorchBackend``: the backend seam on torch, CPU or CUDA.

Traces: on CUDA a trace is a ``torch.cuda.CUDAGraph`` (one memory pool shared
by every capture, warm run before capture). On CPU there is no graph, so a
replay re-runs the captured body, which writes the same persistent buffers:
ownership and overwrite behaviour are those of a device trace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from prefill_core import PrefillPolicy
from prefill_core.values.errors import PrefillConfigError, PrefillStateError
from prefill_shell.device.contract import SAMPLING_INPUTS, TensorSpec
from prefill_shell.device.ledger import DeviceTensor, Ownership, ResourceLedger
from prefill_shell.sampling.torch_sampling import sample_row, top_logprobs

from .base import TraceHandle
from .host_memory import keep_freed_host_memory

__all__ = ["TorchBackend"]


def _checked_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this backend can run on: the CPU or a visible CUDA GPU.

    Checked here, at construction: another device type (``mps``, ``meta``)
    would otherwise run its host paths on the CPU unnoticed, and a missing
    GPU would surface only at the first call.
    """

    def refuse(rule: str) -> PrefillConfigError:
        return PrefillConfigError(f"TorchBackend.device={device!r} is invalid: {rule}")

    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise refuse(f"not a torch device ({error})") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise refuse(f"must be 'cpu' or a CUDA device; {resolved.type!r} is not supported by this backend")
    if not torch.cuda.is_available():
        raise refuse("CUDA is not available in this process (use 'cpu')")
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise refuse(f"this process sees {torch.cuda.device_count()} CUDA device(s)")
    return resolved


class TorchBackend:
    """Device operations on one torch device."""

    name = "torch"
    max_device_top_k = None  # sampling runs in torch: any K
    max_sampled_wave = None
    packed_steps = True  # eager torch runs any shape: real tokens end to end, no padding

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = _checked_device(device)
        self.ledger = ResourceLedger()
        self.is_cuda = self.device.type == "cuda"
        if not self.is_cuda:
            keep_freed_host_memory()  # a step's activations reuse the last step's pages (backends/host_memory.py)
        # Eager CPU torch builds nothing per shape; CUDA loads kernels lazily on their first launch.
        self.compiles_programs = self.is_cuda
        self._graph_pool = torch.cuda.graph_pool_handle() if self.is_cuda else None
        self.captures = 0

    def preferred_policy(self, block_size: int) -> PrefillPolicy:
        """On the CPU, fine rungs and exact waves: no program is compiled per shape, so padding is pure waste.

        Packed steps where the model runs them (eager calls; traced calls are planned padded).
        On CUDA, tt-metal's ladder: each captured CUDA graph is one shape, and
        the ladder bounds how many a warm-up captures.
        """
        if self.is_cuda:
            return PrefillPolicy()
        return attrs.evolve(PrefillPolicy.fine_rungs(block_size), packed_steps=True)

    # -- memory ---------------------------------------------------------
    def upload(self, host: torch.Tensor, spec: TensorSpec, ownership: Ownership) -> DeviceTensor:
        value = host.to(self.device, non_blocking=True) if self.is_cuda else host.clone()
        return self.ledger.register(value, spec, ownership)

    def refresh(self, host: torch.Tensor, target: DeviceTensor) -> None:
        dest = target.value
        if dest.shape != host.shape or dest.dtype != host.dtype:
            msg = (
                f"refresh of {target.name}: host {tuple(host.shape)}/{host.dtype} "
                f"!= device {tuple(dest.shape)}/{dest.dtype}"
            )
            raise PrefillStateError(msg)
        dest.copy_(host, non_blocking=self.is_cuda)

    def adopt(self, value: Any, spec: TensorSpec, ownership: Ownership) -> DeviceTensor:
        return self.ledger.register(value, spec, ownership)

    def read(self, handles: list[DeviceTensor]) -> list[torch.Tensor]:
        if not self.is_cuda:
            # Host and device share memory: a read must copy, or the next
            # replay would overwrite what the caller holds.
            return [h.value.clone() for h in handles]
        pinned = [h.value.to("cpu", non_blocking=True) for h in handles]
        torch.cuda.synchronize(self.device)
        return pinned

    def release(self, handle: DeviceTensor) -> None:
        # Dropping the last reference frees it (the caching allocator on CUDA).
        self.ledger.retire(handle)

    def assign(self, target: DeviceTensor, value: Any) -> None:
        target.value.copy_(value)

    # -- postprocessing -------------------------------------------------
    def gather_rows(self, hidden: Any, index: Any) -> Any:
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), index.long()]  # [B, H]

    def gather_positions(self, hidden: Any, index: Any) -> Any:
        return hidden.reshape(-1, hidden.shape[-1])[index.long()]  # [P, H]

    def argmax(self, logits: Any) -> Any:
        return torch.argmax(logits, dim=-1)

    def sample(self, logits: Any, inputs: Mapping[TensorSpec, Any], seeds: tuple[int, ...]) -> Any:
        # The contract keeps P and T in float64, so ``.tolist()`` gives each
        # row's own Python values, bit for bit: a row samples exactly as host
        # sampling (and as it would in any other wave) would sample it. The
        # per-row sampler takes Python numbers, so on CUDA this read waits for
        # the device once per sampled wave. Each input reaches ``sample_row``
        # as the keyword its spec names.
        columns = {spec.name: inputs[spec].tolist() for spec in SAMPLING_INPUTS}
        tokens = []
        for b, seed in enumerate(seeds):
            row = {name: column[b] for name, column in columns.items()}
            tokens.append(sample_row(logits[b], **row, seed=seed))
        return torch.stack(tokens)

    def logprobs(self, logits: Any, tokens: Any, top_n: int) -> tuple[Any, Any, Any]:
        return top_logprobs(logits, tokens, top_n)

    # -- traces ---------------------------------------------------------
    def capture(self, key: str, body: Callable[[], None]) -> TraceHandle:
        self.captures += 1
        if not self.is_cuda:
            body()  # the capture run: compiles nothing, fills the buffers once
            return TraceHandle(key, body)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            body()  # warm-up outside the graph (cuBLAS handles, allocator)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            body()
        return TraceHandle(key, graph)

    def replay(self, trace: TraceHandle) -> None:
        if trace.released:
            raise PrefillStateError(f"trace {trace.key} was replayed after it was released")
        if self.is_cuda:
            trace.payload.replay()
        else:
            trace.payload()

    def release_trace(self, trace: TraceHandle) -> None:
        if trace.released:
            raise PrefillStateError(f"trace {trace.key} was released twice")
        trace.released = True
        trace.payload = None
