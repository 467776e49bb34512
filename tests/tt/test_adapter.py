"""``TtModelAdapter``: the runtime's model calls become exactly the TTTv2 calls of tt-metal's prefill runtime.

Runs on the EMULATION with the stand-in model (tests/tt/reference_standin.py),
whose signatures are the protocol's, so an invented keyword fails here.
"""

from __future__ import annotations

import inspect

import pytest

from prefill_shell.tt.adapter import TtModel, TtModelAdapter
from tests.tt.emulated_lanes import EmulatedLane, call_args
from tests.tt.reference_standin import ReferenceLlamaStandIn

REGULAR_KEYWORDS = {
    "user_id",
    "page_table",
    "chunk_page_table",
    "get_last_token",
    "batch_size",
    "chunk_start_idx_tensor",
}
"""``runtime.py`` (0277e5a6) ``_run_hidden_body``'s keywords."""
CHUNK_KEYWORDS = {
    "user_id",
    "page_table",
    "chunk_page_table",
    "chunk_start_idx",
    "get_last_token",
    "chunk_start_idx_tensor",
    "last_token_slice",
    "last_token_index",
}
"""``runtime.py`` (0277e5a6) ``_run_chunk_hidden_body``'s keywords."""


def _shape(function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize(
    "method", ["embed_prefill", "prepare_prefill_rot_mats", "prefill_forward", "post_process_prefill_output"]
)
def test_the_stand_in_has_exactly_the_protocol_signatures(method):
    """Every TtModel method of the stand-in has the protocol's parameter names, kinds and defaults, and no **kwargs."""
    ours = _shape(getattr(ReferenceLlamaStandIn, method))
    assert ours == _shape(getattr(TtModel, method))
    assert all(kind is not inspect.Parameter.VAR_KEYWORD for _, kind, _ in ours)


@pytest.fixture
def lane(ttnn):
    return EmulatedLane(ttnn)


def _spy(lane, monkeypatch) -> list[set[str]]:
    seen: list[set[str]] = []
    original = lane.standin.prefill_forward

    def spy(x_embed, rot_mats, **keywords):
        seen.append(set(keywords))
        return original(x_embed, rot_mats, **keywords)

    monkeypatch.setattr(lane.standin, "prefill_forward", spy)
    return seen


def test_a_regular_wave_uses_the_seed_hidden_body_keywords(lane, monkeypatch):
    """A padded wave of 4: one call with the regular keywords, batch_size=4 and user_id=[0, 1, 2, 3]."""
    seen = _spy(lane, monkeypatch)
    lane.executor.prefill(**call_args([100, 70, 128]), mode="eager")
    assert seen == [REGULAR_KEYWORDS]
    assert lane.standin.calls[-1]["batch_size"] == 4 and lane.standin.calls[-1]["user_id"] == [0, 1, 2, 3]


def test_a_chunked_row_uses_the_seed_chunk_body_keywords_with_a_tensor_start(lane, monkeypatch):
    """Three chunks, each with the chunk keywords, chunk_start_idx=None and the start as a tensor."""
    seen = _spy(lane, monkeypatch)
    lane.executor.prefill(**call_args([300]), mode="eager")
    assert seen == [CHUNK_KEYWORDS] * 3
    assert all(c["chunked"] and c["chunk_start_idx"] is None for c in lane.standin.calls)


def test_the_adapter_refuses_a_model_without_the_protocol(lane):
    """An object lacking prefill_forward is refused when the adapter is built."""

    class EmbedOnly:
        def embed_prefill(self, tokens):
            return tokens

    with pytest.raises(TypeError, match="does not implement TtModel"):
        TtModelAdapter(EmbedOnly(), lane.model.spec, mesh_device=lane.emu.mesh, ttnn_module=lane.emu)
