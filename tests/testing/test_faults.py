"""The fault-injecting backend writes out every ``Backend`` protocol member: one the protocol gains fails here."""

from __future__ import annotations

from typing import Protocol

import pytest
import torch

from prefill_shell.backends import TorchBackend
from prefill_shell.backends.base import Backend
from prefill_shell.device.contract import SLOTS
from prefill_shell.device.ledger import Ownership
from prefill_shell.testing import FaultInjectingBackend, FaultPlan, InjectedFault


def _unwrapped(protocol: type, wrapper: object) -> set[str]:
    """Members of ``protocol`` that ``wrapper`` does not define itself (methods on its class, data on the instance)."""
    methods = {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}
    data = set(vars(protocol).get("__annotations__", {}))
    return (methods - set(vars(type(wrapper)))) | (data - set(vars(wrapper)))


@pytest.fixture
def wrapper():
    return FaultInjectingBackend(TorchBackend(), FaultPlan())


def test_every_backend_protocol_member_is_wrapped_explicitly(wrapper):
    """Each Backend method is defined on FaultInjectingBackend and each Backend attribute set on the instance."""
    assert {"sample", "upload", "replay", "ledger", "max_device_top_k"} <= set(vars(Backend)) | set(
        Backend.__annotations__
    )
    assert _unwrapped(Backend, wrapper) == set()
    assert isinstance(wrapper, Backend)


def test_a_member_the_protocol_gains_is_reported_unwrapped(wrapper):
    """The check fails for a protocol grown by one method and one attribute the wrapper does not define."""

    class Grown(Backend, Protocol):
        max_prefetch: int

        def evict(self, handle) -> None: ...

    assert _unwrapped(Grown, wrapper) == {"evict", "max_prefetch"}


def test_the_wrapper_forwards_nothing_implicitly(wrapper):
    """No __getattr__: a backend attribute outside the protocol is reached through ``inner`` only."""
    assert "__getattr__" not in vars(FaultInjectingBackend)
    with pytest.raises(AttributeError):
        wrapper.captures  # noqa: B018 (a TorchBackend attribute, not a protocol member)
    assert wrapper.inner.captures == 0


def test_the_wrapped_device_calls_are_fault_points(wrapper):
    """upload is a fault point: the plan's first counted call raises InjectedFault and nothing is allocated."""
    wrapper.plan.arm(1)
    with pytest.raises(InjectedFault):
        wrapper.upload(torch.zeros(2, dtype=torch.int32), SLOTS, Ownership.INVOCATION)
    assert wrapper.ledger.live() == []
