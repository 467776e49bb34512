"""Hostile inputs on the Tenstorrent path, checked against ttnn itself and tt-metal's prefill staging.

Real ttnn host tensors and the emulation (ttnn's golden functions); nothing
here needs a device. Each test names the tt-metal source it compares with.
"""

from __future__ import annotations

import torch

from prefill_shell.executor import PrefillExecutor
from prefill_shell.reference import random_llama
from tests.helpers import build_runtime
from tests.tt.emulated_lanes import BLOCK, POLICY, call_args
from tests.tt.reference_standin import ReferenceLlamaStandIn

SHORT_TABLE = 256
"""A model whose rotary table (``max_position``) ends inside a 128-token chunk's padding."""


def _short_llama():
    return random_llama(0, "tiny", dtype="bfloat16", max_position_embeddings=SHORT_TABLE)


def _ttnn_executor(ttnn, llama):
    from prefill_shell.tt.adapter import TtModelAdapter
    from prefill_shell.tt.backend import TtnnBackend
    from prefill_shell.tt.emulation import ReferenceEmulation

    emu = ReferenceEmulation(ttnn)
    kv = llama.new_kv_cache(16, BLOCK)
    model = TtModelAdapter(ReferenceLlamaStandIn(emu, llama, kv), llama.spec, mesh_device=emu.mesh, ttnn_module=emu)
    backend = TtnnBackend(emu.mesh, ttnn_module=emu)
    return emu, model, PrefillExecutor(build_runtime(model, policy=POLICY, backend=backend, kv=kv))


def test_chunk_positions_past_the_rotary_table_are_clamped_to_its_last_row(ttnn):
    """positions() equals tt-metal's staged form: arange(start, start + S).clamp(max=max_position - 1), uint32 [1, S].

    tt-metal ``models/common/llm_runtime/prefill/inputs.py`` (8d0a02eb,
    ``prepare_host_inputs``) clamps on the host; a TTTv2 model gathers the
    rotary rows with ``ttnn.embedding``, which does not bound its ids.
    """
    emu, model, _ = _ttnn_executor(ttnn, _short_llama())
    start = emu.to_device(
        ttnn.Tensor(torch.tensor([160], dtype=torch.int32).numpy(), ttnn.int32, None, ttnn.ROW_MAJOR_LAYOUT)
    )
    positions = model.positions(start, 128, chunked=True)
    assert (positions.dtype, positions.layout, tuple(positions.shape)) == (ttnn.uint32, ttnn.ROW_MAJOR_LAYOUT, (1, 128))
    got = ttnn.to_torch(positions.host).to(torch.int64)
    want = torch.arange(160, 288).clamp(max=SHORT_TABLE - 1).reshape(1, 128)
    assert torch.equal(got, want)


def test_a_final_chunk_whose_padding_runs_past_the_rotary_table_runs_and_matches_torch(ttnn):
    """A 256-token row cached 32 on a 256-position model: its last chunk is 160..287; logits equal the torch twin's."""
    llama = _short_llama()
    _, _, executor = _ttnn_executor(ttnn, llama)
    args = call_args([SHORT_TABLE], cached=[32])
    args["tokens"] = args["tokens"] % llama.spec.vocab_size
    got = executor.prefill(**args, mode="eager")
    want = PrefillExecutor(build_runtime(llama, num_blocks=16, block_size=BLOCK, policy=POLICY)).prefill(
        **args, mode="eager"
    )
    for g, w in zip(got, want):
        assert (g.logits - w.logits).abs().max().item() <= 0.02 * w.logits.abs().max().item()
