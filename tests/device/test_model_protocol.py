"""The model protocol declares every forward the runtime calls, and each shipped model implements its kind.

``PrefillModel`` (padded steps), ``PackedPrefillModel`` (packed steps) and
``GroupedPrefillModel`` (KV groups): the reference Llama is the first two, a
``HybridLlama`` the first and the third, and every method the runtime's step
dispatch calls is declared by one of them, with the parameters it is called with.
"""

from __future__ import annotations

import inspect
import re

from prefill_shell.device.contract import GROUPED_INPUTS, GROUPED_PACKED_INPUTS, PACKED_INPUTS
from prefill_shell.device.model import (
    GroupedPrefillModel,
    PackedPrefillModel,
    PrefillModel,
    SegmentEndsPrefillModel,
    SharedWritesPrefillModel,
    supports_shared_writes,
)
from prefill_shell.engine.steps import call_steps
from prefill_shell.reference import random_llama
from prefill_shell.reference.windows.hybrid import HybridLlama
from tests import window_kit as kit


def _params(protocol, name: str) -> list[str]:
    return [p for p in inspect.signature(getattr(protocol, name)).parameters if p != "self"]


def test_the_shipped_models_implement_their_protocols():
    """The reference Llama runs padded and packed steps (segment ends alone on request); a HybridLlama padded and
    packed grouped steps."""
    llama = random_llama(0, "tiny")
    assert isinstance(llama, PrefillModel) and isinstance(llama, SegmentEndsPrefillModel)
    assert isinstance(llama, SharedWritesPrefillModel) and supports_shared_writes(llama)
    assert not isinstance(llama, GroupedPrefillModel)
    hybrid = HybridLlama(llama, kit.attention_of(("sliding_attention",) * llama.spec.num_layers, 16, 16))
    assert isinstance(hybrid, GroupedPrefillModel) and not supports_shared_writes(hybrid)
    assert _params(GroupedPrefillModel, "forward_grouped") == list(inspect.signature(hybrid.forward_grouped).parameters)
    # the packed protocol's parameters come first, then each capability's keyword-only option, and no other
    packed = _params(PackedPrefillModel, "forward_packed")
    options = []
    for protocol in (SegmentEndsPrefillModel, SharedWritesPrefillModel):
        declared = _params(protocol, "forward_packed")
        assert declared[:-1] == packed
        options.append(declared[-1])
    assert list(inspect.signature(llama.forward_packed).parameters) == packed + options


def test_every_forward_the_runtime_calls_is_declared_with_its_inputs():
    """Each ``forward_*`` method the runtime's dispatch (``call_steps.body_call``) names is a protocol method;
    the packed and grouped ones take the contract's inputs in the contract's order, then the pool."""
    source = inspect.getsource(call_steps.body_call)
    names = set(re.findall(r'"(forward_[a-z_]+)"', source))
    declared = {n for proto in (PrefillModel, PackedPrefillModel, GroupedPrefillModel) for n in dir(proto)}
    assert names and names <= declared
    assert len(_params(PackedPrefillModel, "forward_packed")) == len(PACKED_INPUTS) + 1
    assert len(_params(GroupedPrefillModel, "forward_grouped")) == 2 + len(GROUPED_INPUTS) + 1
    assert len(_params(GroupedPrefillModel, "forward_packed_grouped")) == len(GROUPED_PACKED_INPUTS) + 1
