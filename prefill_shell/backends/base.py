"""The backend seam: every device operation the runtime needs, and nothing else.

A backend moves host values (torch CPU tensors) to its device and back, runs
the few postprocessing ops the runtime owns (last-token gather, argmax,
sampling, log-softmax), and captures/replays traces. Model bodies are not
backend ops: the runtime borrows the model and calls it directly.

Every tensor a backend creates is registered in its ``ledger`` so tests can
prove nothing leaks; ``release`` frees first and retires the handle only when
the free succeeded, so a failed release leaves a live handle (an orphan).
Tensors are identified by their ``contract.TensorSpec``: a backend stages,
converts and reads back by spec, never by parsing a name.

Capabilities, checked once by ``PrefillRuntimeConfig.resolve``:
``max_device_top_k`` (the largest K device sampling takes; ``None``: no
limit) and ``max_sampled_wave`` (the most rows one device-sampling call
serves; ``None``: no limit), ``packed_steps`` (whether it stages and runs
packed steps, ``prefill_core.planning.packed``: the contract's ``PACKED_INPUTS``;
ttnn does not, its programs are padded waves), ``compiles_programs`` (whether an eager run of
a new shape builds a program: a warm-up runs compile bodies only where it does,
``prefill_core.calls.warmup``). ``preferred_policy`` is the planning policy
the backend wants when the caller gives none: a device that compiles a
program per shape wants tt-metal's coarse ladder; an eager CPU wants every
padded position gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from prefill_core import PrefillPolicy
from prefill_shell.device.contract import TensorSpec
from prefill_shell.device.ledger import DeviceTensor, Ownership, ResourceLedger

__all__ = ["Backend", "TraceHandle"]


class TraceHandle:
    """A captured trace: its replay callable (backend-specific) and liveness."""

    __slots__ = ("key", "payload", "released")

    def __init__(self, key: str, payload: Any):
        self.key = key
        self.payload = payload
        self.released = False


@runtime_checkable
class Backend(Protocol):
    """Device operations of the prefill runtime (torch or ttnn)."""

    ledger: ResourceLedger
    device: Any
    max_device_top_k: int | None
    max_sampled_wave: int | None
    packed_steps: bool
    compiles_programs: bool

    def preferred_policy(self, block_size: int) -> PrefillPolicy:
        """The policy ``PrefillRuntimeConfig.resolve`` uses when the caller gives none."""

    # -- memory ---------------------------------------------------------
    def upload(self, host: torch.Tensor, spec: TensorSpec, ownership: Ownership) -> DeviceTensor:
        """Allocates a device tensor holding ``host`` (in ``spec``'s host dtype and shape)."""

    def refresh(self, host: torch.Tensor, target: DeviceTensor) -> None:
        """Copies ``host`` into the existing ``target`` in place (same shape and dtype)."""

    def adopt(self, value: Any, spec: TensorSpec, ownership: Ownership) -> DeviceTensor:
        """Registers a tensor something else produced (a model output) in the ledger."""

    def read(self, handles: list[DeviceTensor]) -> list[torch.Tensor]:
        """Host copies of ``handles`` in their specs' host dtypes: start every transfer, then synchronize once."""

    def release(self, handle: DeviceTensor) -> None:
        """Frees ``handle``; may raise, leaving the handle live (an orphan to retry)."""

    def assign(self, target: DeviceTensor, value: Any) -> None:
        """Device-to-device copy of ``value`` into the existing ``target`` (no allocation)."""

    # -- postprocessing: raw device values in, raw device values out -----
    # The postprocessor decides ownership: eager results are registered as
    # invocation transients, traced results are assigned into an alias's
    # persistent workspace.
    def gather_rows(self, hidden: Any, index: Any) -> Any:
        """``hidden[b, index[b]]`` for every row b: ``[B, S, H] -> [B, H]``."""

    def gather_positions(self, hidden: Any, index: Any) -> Any:
        """Rows ``index[p]`` of ``hidden`` seen as ``[B*S, H]`` (row ``b*S + i`` is position i of row b): ``[P, H]``."""

    def argmax(self, logits: Any) -> Any:
        """Greedy tokens ``[B]`` from logits ``[B, V]``."""

    def sample(self, logits: Any, inputs: Mapping[TensorSpec, Any], seeds: tuple[int, ...]) -> Any:
        """Per-row sampling with per-row seeds: ``[B]`` tokens.

        ``inputs`` maps every ``contract.SAMPLING_INPUTS`` spec (``TOP_K``,
        ``TOP_P``, ``TEMPERATURE``) to the device value of the tensor this
        backend uploaded or refreshed from ``contract.sampling_values`` (one
        entry per physical row; padding rows repeat row 0, so a single row's
        values are broadcast to the wave; greedy rows hold K=1, P=1, T=1).
        Read them by key, never by position. They stay owned by the caller.
        """

    def logprobs(self, logits: Any, tokens: Any, top_n: int) -> tuple[Any, Any, Any]:
        """Raw log-softmax at ``tokens`` ``[B]`` and (``top_n > 0``) top-N ids/values ``[B, N]``."""

    # -- traces ---------------------------------------------------------
    def capture(self, key: str, body) -> TraceHandle:
        """Captures ``body()`` (which writes only persistent buffers) as a trace."""

    def replay(self, trace: TraceHandle) -> None:
        """Replays ``trace`` against the current contents of its persistent inputs."""

    def release_trace(self, trace: TraceHandle) -> None:
        """Frees ``trace``; replaying it afterwards raises ``PrefillStateError``."""
