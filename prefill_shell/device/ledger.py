"""Every device resource the runtime creates, with its owner, until it is released.

The ledger is how tests prove that nothing stays alive: each allocation and
each release goes through it, and ``live()`` lists what is still held. A
``DeviceTensor`` handle refuses use after release with a named error instead
of reading freed (or, on a device, reused) memory.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from typing import Any

from prefill_core.values.errors import PrefillStateError

__all__ = ["Ownership", "DeviceTensor", "ResourceLedger"]


class Ownership(enum.Enum):
    """Who releases a tensor (docs/design.md, "Ownership")."""

    INVOCATION = "invocation"  # released by the result collector (or on failure)
    TRACE = "trace"  # persistent inputs/outputs of a captured trace
    WORKSPACE = "workspace"  # per-program-alias postprocessing buffers
    BORROWED = "borrowed"  # the caller's or the model's; never released by us


class DeviceTensor:
    """A handle to one backend tensor that knows its owner and whether it was released."""

    __slots__ = ("id", "spec", "ownership", "_value", "_ledger")

    def __init__(self, ledger: ResourceLedger, value: Any, spec: Any, ownership: Ownership):
        self.id = next(ledger._ids)
        self.spec = spec  # its entry in the tensor contract (``contract.TensorSpec``)
        self.ownership = ownership
        self._value = value
        self._ledger = ledger

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def released(self) -> bool:
        return self._value is None

    @property
    def value(self) -> Any:
        if self._value is None:
            msg = f"device tensor #{self.id} ({self.name}) was used after it was released"
            raise PrefillStateError(msg)
        return self._value

    def __repr__(self) -> str:
        state = "released" if self.released else "live"
        return f"DeviceTensor(#{self.id} {self.name} {self.ownership.value} {state})"


class ResourceLedger:
    """Counts allocations and releases per ownership; lists what is live."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._live: dict[int, DeviceTensor] = {}
        self.allocations = 0
        self.releases = 0

    def register(self, value: Any, spec: Any, ownership: Ownership) -> DeviceTensor:
        handle = DeviceTensor(self, value, spec, ownership)
        self._live[handle.id] = handle
        self.allocations += 1
        return handle

    def retire(self, handle: DeviceTensor) -> Any:
        """Marks ``handle`` released and returns its value for the backend to free."""
        value = handle.value
        handle._value = None
        del self._live[handle.id]
        self.releases += 1
        return value

    def live(self, ownership: Ownership | Iterable[Ownership] | None = None) -> list[DeviceTensor]:
        if ownership is None:
            return list(self._live.values())
        kinds = {ownership} if isinstance(ownership, Ownership) else set(ownership)
        return [h for h in self._live.values() if h.ownership in kinds]
