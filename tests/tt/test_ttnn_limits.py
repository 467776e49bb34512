"""Hostile inputs on the Tenstorrent path, checked against ttnn itself and tt-metal's prefill staging.

Real ttnn host tensors and the emulation (ttnn's golden functions); nothing
here needs a device. Each test names the tt-metal source it compares with.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams
from prefill_core.values.errors import PrefillInputError
from prefill_shell.device.contract import PROMPT_TARGETS, SAMPLED_TOKENS
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference import random_llama
from prefill_shell.tt import staging as ttnn_staging
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


@pytest.mark.parametrize("spec", [PROMPT_TARGETS, SAMPLED_TOKENS])
@pytest.mark.parametrize("bad", [-1, 2**32])
def test_uint32_vectors_refuse_ids_outside_uint32_instead_of_wrapping(ttnn, spec, bad):
    """A -1 filler or 2**32 staged as uint32 raises naming the spec; numpy would wrap them to 4294967295 and 0."""
    with pytest.raises(PrefillInputError, match=rf"{spec.name}\[2\]={bad}") as info:
        ttnn_staging.stage(spec, torch.tensor([5, 0, bad]))
    assert info.value.field == spec.name


def test_uint32_vectors_keep_the_extremes_exact(ttnn):
    """0 and 2**32 - 1 round-trip exactly through the uint32 staging of a target vector."""
    staged = ttnn_staging.stage(PROMPT_TARGETS, torch.tensor([0, 2**32 - 1, 2**24 + 1]))
    assert staged.dtype == ttnn.uint32
    assert ttnn.to_torch(staged).to(torch.int64).reshape(-1).tolist() == [0, 2**32 - 1, 2**24 + 1]


@pytest.mark.parametrize(("width", "index_dtype"), [(65504, "uint16"), (65530, "uint32"), (65536, "uint32")])
def test_emulated_topk_index_dtype_follows_the_padded_width(ttnn, width, index_dtype):
    """tt-metal's TopK output spec (topk_device_operation.cpp): uint16 indices only while the padded width < 65536."""
    emu = _emulation(ttnn)
    logits = emu.to_device(ttnn.from_torch(torch.randn(1, 1, 2, width), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT))
    values, indices = emu.topk(logits, 4, dim=3)
    assert indices.dtype == getattr(ttnn, index_dtype)
    assert (values.dtype, indices.layout) == (ttnn.float32, ttnn.TILE_LAYOUT)


@pytest.mark.parametrize("width", [16, 96])
def test_emulated_sampling_refuses_a_width_the_device_refuses(ttnn, width):
    """ttnn.sampling refuses a W not a multiple of 32 or W / 32 not a power of two; so does the emulation.

    tt-metal ``sampling_device_operation.cpp`` (``validate_on_program_cache_miss``).
    """
    from prefill_shell.tt.emulation import EmulationError

    emu = _emulation(ttnn)
    rm = ttnn.ROW_MAJOR_LAYOUT

    def put(array, dtype, layout=rm):
        return emu.to_device(ttnn.from_torch(array, dtype=dtype, layout=layout))

    values = put(torch.randn(1, 1, 2, width).bfloat16(), ttnn.bfloat16, ttnn.TILE_LAYOUT)
    indices = put(torch.arange(2 * width, dtype=torch.int32).reshape(1, 1, 2, width), ttnn.uint32)
    k = put(torch.tensor([2, 2], dtype=torch.int32), ttnn.uint32)
    p, temp = (put(torch.ones(2).bfloat16(), ttnn.bfloat16) for _ in range(2))
    with pytest.raises(EmulationError, match="sampling: W"):
        emu.sampling(values, indices, k=k, p=p, temp=temp, seed=1)


def _emulation(ttnn):
    from prefill_shell.tt.emulation import ReferenceEmulation

    return ReferenceEmulation(ttnn)


@pytest.mark.parametrize(("seed", "passed"), [(0, 0xFFFFFFFF), (2**32, 0xFFFFFFFF), (3, 3), (2**40 + 5, 5)])
def test_ttnn_sampling_never_gets_seed_zero(ttnn, monkeypatch, seed, passed):
    """The sampling kernel reseeds only for a non-zero seed (sampling.cpp, generate_rand_tile): 0 is never passed."""
    from prefill_shell.device.contract import LOGITS, TEMPERATURE, TOP_K, TOP_P, sampling_values
    from prefill_shell.device.ledger import Ownership
    from prefill_shell.tt import emulation_ops
    from prefill_shell.tt.backend import TtnnBackend

    seen = []
    original = emulation_ops.OPS["sampling"]

    def spy(*args, seed=None, **kwargs):
        seen.append(seed)
        return original(*args, seed=seed, **kwargs)

    monkeypatch.setitem(emulation_ops.OPS, "sampling", spy)
    emu = _emulation(ttnn)
    backend = TtnnBackend(emu.mesh, ttnn_module=emu)
    logits = backend.upload(torch.randn(2, 64), LOGITS, Ownership.INVOCATION).value
    values = sampling_values((SamplingParams(temperature=0.7, top_k=5, seed=seed),) * 2)
    inputs = {s: backend.upload(values[s], s, Ownership.INVOCATION).value for s in (TOP_K, TOP_P, TEMPERATURE)}
    backend.sample(logits, inputs, (seed, seed))
    assert seen == [passed]
