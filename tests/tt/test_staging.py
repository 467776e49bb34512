"""Host staging for the ttnn backend: exact dtypes, layouts, shapes and values for every planned request.

Real ttnn host tensors throughout; tilizing conversions run under the
one-chip mock cluster descriptor the ``ttnn`` fixture installs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import PageTableLayout, PrefillBatch, PrefillPolicy, PrefillRow, SamplingParams, plan_prefill
from prefill_core.values.errors import PrefillInputError
from prefill_shell.device.contract import (
    ALL_SPECS,
    CHUNK_START,
    FILL_TABLE,
    INPUT_TOKENS,
    LAST_HIDDEN,
    LAST_TOKEN_INDEX,
    LOGITS,
    READ_TABLE,
    SAMPLED_TOKENS,
    SLOTS,
    TEMPERATURE,
    TOKEN_LOGPROB,
    TOP_IDS,
    TOP_K,
    TOP_LOGPROBS,
    TOP_P,
    Stage,
    TensorSpec,
    sampling_values,
)
from prefill_shell.engine.steps.inputs import build_host_steps
from prefill_shell.tt import staging as ttnn_staging

POLICY = PrefillPolicy(
    waves=(1, 2, 4, 8), length_ladder=(64, 128), max_chunk_length=128, chunk_quantum=128, max_batch_size=8, lane_size=16
)
"""Rows above 128 tokens, and every cached row, are chunked at 128: every request kind occurs at small sizes."""

VOCAB = 50_000


@st.composite
def sampling(draw) -> SamplingParams:
    return SamplingParams(
        temperature=draw(st.sampled_from((0.0, 0.7, 1.0, 1.3))),
        top_k=draw(st.sampled_from((1, 2, 5, 32))),
        top_p=draw(st.sampled_from((0.5, 0.9, 1.0))),
        num_logprobs=draw(st.integers(0, 3)),
    )


@st.composite
def planned(draw):
    """``(tokens, requests)``: a small valid batch, its caller tokens, and its plan."""
    bs = draw(st.sampled_from((16, 32)))
    num_rows = draw(st.integers(1, 6))
    slots = draw(st.lists(st.integers(0, POLICY.lane_size - 1), min_size=num_rows, max_size=num_rows, unique=True))
    rows, next_block = [], 0
    sampled = draw(st.booleans())
    for slot in slots:
        length = draw(st.integers(1, 400))
        cached = draw(st.sampled_from((0, 0, length // bs * bs, (length // bs) // 2 * bs)))
        need = -(-length // bs)
        blocks = tuple(range(next_block, next_block + need))
        next_block += need
        params = draw(sampling()) if sampled else None
        rows.append(PrefillRow(length, cached, slot, blocks, params))
    layout = PageTableLayout(bs, 64, next_block + 1)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    tokens = torch.randint(1, VOCAB, (num_rows, 400), generator=generator)
    return tokens, plan_prefill(PrefillBatch.from_rows(tuple(rows)), POLICY, layout)


def assert_staged(ttnn, tensor, dtype, layout, shape, expected: torch.Tensor) -> None:
    assert tensor.dtype == dtype
    assert tensor.layout == layout
    assert tuple(tensor.shape) == tuple(shape)
    if layout == ttnn.ROW_MAJOR_LAYOUT:
        assert tuple(tensor.padded_shape) == tuple(shape)  # row-major tensors carry no padding
    back = ttnn.to_torch(tensor)
    assert back.shape == expected.shape
    assert torch.equal(back.to(expected.dtype), expected), "the host round trip must be exact"


@given(case=planned())
def test_every_step_of_every_planned_request_is_staged_in_the_ttnn_contract(ttnn, case):
    """input tokens uint32 [1,1,B,S]; tables int32 [B,W]; chunk start/slots/last-token index int32 [B]; all exact."""
    tokens, requests = case
    rm = ttnn.ROW_MAJOR_LAYOUT
    for request in requests:
        for step in build_host_steps(tokens, request):
            b, s = step[INPUT_TOKENS].shape
            staged = {spec: ttnn_staging.stage(spec, value) for spec, value in step.items()}
            assert set(staged) == {INPUT_TOKENS, CHUNK_START, SLOTS, FILL_TABLE, LAST_TOKEN_INDEX} | (
                {READ_TABLE} if request.kind.is_chunked else set()
            )
            assert_staged(
                ttnn, staged[INPUT_TOKENS], ttnn.uint32, rm, (1, 1, b, s), step[INPUT_TOKENS].reshape(1, 1, b, s)
            )
            for table in (FILL_TABLE, READ_TABLE):
                if table in step:
                    assert_staged(ttnn, staged[table], ttnn.int32, rm, tuple(step[table].shape), step[table])
            for spec in (CHUNK_START, SLOTS, LAST_TOKEN_INDEX):
                assert_staged(ttnn, staged[spec], ttnn.int32, rm, (b,), step[spec].to(torch.int32))


@given(case=planned())
def test_sampling_params_of_every_wave_stage_as_k_uint32_p_and_inverse_t_bfloat16(ttnn, case):
    """K uint32, P and 1/T bfloat16, ROW_MAJOR [B]; padding rows repeat row 0; greedy rows are k=1, p=1, 1/T=1."""
    _, requests = case
    rm = ttnn.ROW_MAJOR_LAYOUT
    for request in requests:
        if request.sampling[0] is None:
            continue
        pad = request.padded_batch - request.active_batch_size
        params = request.sampling + (request.sampling[0],) * pad
        values = sampling_values(params)
        k, p, inverse_t = (ttnn_staging.stage(spec, values[spec]) for spec in (TOP_K, TOP_P, TEMPERATURE))
        b = request.padded_batch
        greedy = [q.is_greedy for q in params]
        want_k = torch.tensor([1 if g else q.top_k for g, q in zip(greedy, params)])
        want_p = torch.tensor([1.0 if g else q.top_p for g, q in zip(greedy, params)]).bfloat16()
        want_t = torch.tensor([1.0 if g else 1 / q.temperature for g, q in zip(greedy, params)]).bfloat16()
        assert_staged(ttnn, k, ttnn.uint32, rm, (b,), want_k)
        assert_staged(ttnn, p, ttnn.bfloat16, rm, (b,), want_p)
        assert_staged(ttnn, inverse_t, ttnn.bfloat16, rm, (b,), want_t)


def test_a_p_or_inverse_t_below_the_smallest_bfloat16_normal_stages_as_that_normal(ttnn):
    """P and 1/T never stage as 0 (or a subnormal): a tinier one becomes bfloat16's smallest normal, the rest round."""
    params = (
        SamplingParams(temperature=1e308, top_k=32, top_p=1e-46),
        SamplingParams(temperature=1e-5, top_k=2, top_p=0.5),
    )
    values = sampling_values(params)
    tiny = torch.finfo(torch.bfloat16).tiny
    p = ttnn.to_torch(ttnn_staging.stage(TOP_P, values[TOP_P])).float()
    inverse_t = ttnn.to_torch(ttnn_staging.stage(TEMPERATURE, values[TEMPERATURE])).float()
    assert torch.equal(p, torch.tensor([tiny, 0.5]).bfloat16().float())
    assert torch.equal(inverse_t, torch.tensor([tiny, 1e5]).bfloat16().float())


def test_a_temperature_whose_inverse_overflows_bfloat16_is_refused_when_staged_alone(ttnn):
    """Staged alone, a T below 1/bfloat16-max cannot become the greedy triple: it raises, naming the field."""
    with pytest.raises(PrefillInputError, match="overflows bfloat16") as info:
        ttnn_staging.stage(TEMPERATURE, torch.tensor([1.0, 1e-39], dtype=torch.float64))
    assert info.value.field == "sampling.temperature"


@pytest.mark.parametrize(("b", "s", "h"), [(1, 128, 64), (3, 40, 96), (2, 32, 4096)])
def test_hidden_activation_tilizes_to_bfloat16_tile_b_1_s_h(ttnn, b, s, h):
    """A body activation [B, S, H] stages as bfloat16 TILE [B, 1, S, H], padded to whole tiles, values exact."""
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(b * s))
    staged = ttnn_staging.stage_hidden(x)
    assert (staged.dtype, staged.layout) == (ttnn.bfloat16, ttnn.TILE_LAYOUT)
    assert tuple(staged.shape) == (b, 1, s, h)
    assert tuple(staged.padded_shape) == (b, 1, -(-s // 32) * 32, -(-h // 32) * 32)
    assert torch.equal(ttnn.to_torch(staged), x.reshape(b, 1, s, h).bfloat16())


def test_float32_to_bfloat16_tilization_runs_under_the_mock_cluster(ttnn):
    """The conversion that needs a cluster descriptor (a new dtype into TILE) works with the shipped mock."""
    x = torch.randn(1, 1, 40, 64, generator=torch.Generator().manual_seed(0))
    staged = ttnn.from_torch(x, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT)
    assert tuple(staged.padded_shape) == (1, 1, 64, 64)
    assert torch.equal(ttnn.to_torch(staged), x.bfloat16())


WORKSPACE = {
    # spec: (host shape, device dtype, device layout, device shape)
    LAST_TOKEN_INDEX: ((4,), "int32", "ROW_MAJOR", (4,)),
    LAST_HIDDEN: ((4, 64), "bfloat16", "TILE", (1, 1, 4, 64)),
    LOGITS: ((4, 256), "float32", "TILE", (1, 1, 4, 256)),
    SAMPLED_TOKENS: ((4,), "uint32", "ROW_MAJOR", (1, 1, 1, 4)),
    TOKEN_LOGPROB: ((4,), "float32", "ROW_MAJOR", (1, 1, 1, 4)),
    TOP_IDS: ((4, 5), "uint32", "ROW_MAJOR", (1, 1, 4, 5)),
    TOP_LOGPROBS: ((4, 5), "float32", "ROW_MAJOR", (1, 1, 4, 5)),
}


@pytest.mark.parametrize("spec", list(WORKSPACE), ids=lambda spec: spec.name)
def test_workspace_outputs_stage_in_the_form_the_device_ops_produce(ttnn, spec):
    """Every workspace tensor has the dtype, layout and shape ``TtnnBackend.assign`` copies into."""
    host_shape, dtype, layout, shape = WORKSPACE[spec]
    staged = ttnn_staging.stage(spec, torch.zeros(host_shape))
    assert staged.dtype == getattr(ttnn, dtype)
    assert staged.layout == getattr(ttnn, f"{layout}_LAYOUT")
    assert tuple(staged.shape) == shape
    contract = ttnn_staging.contract_of(spec)
    assert (contract.dtype, contract.layout) == (dtype, layout)


def test_every_contract_entry_has_a_ttnn_staging(ttnn):
    """Each tensor the contract declares ttnn stages has a staging: a new entry cannot miss the ttnn path."""
    staged = [spec for spec in ALL_SPECS if spec.staged_on("ttnn")]
    assert (
        len(staged) >= len(ALL_SPECS) - 9
    )  # only packed-step inputs (plain, shared writes, per KV group) are torch-only
    for spec in staged:
        assert ttnn_staging.contract_of(spec).dtype in ("uint32", "int32", "float32", "bfloat16")


def test_specs_declared_off_ttnn_have_no_ttnn_staging(ttnn):
    """A spec the contract declares ttnn does not stage (packed-step inputs: ttnn keeps padded waves) has none."""
    unstaged = [spec for spec in ALL_SPECS if not spec.staged_on("ttnn")]
    assert {spec.name for spec in unstaged} >= {"packed_tokens", "packed_write_slots", "group_write_slots"}
    for spec in unstaged:
        with pytest.raises(KeyError, match=spec.name):
            ttnn_staging.contract_of(spec)


def test_input_tokens_and_sampled_tokens_stage_differently(ttnn):
    """The token matrix a body reads and the tokens sampling returns are two contract entries with two forms."""
    host = torch.arange(8).reshape(2, 4)
    a = ttnn_staging.stage(INPUT_TOKENS, host)
    b = ttnn_staging.stage(SAMPLED_TOKENS, host.reshape(-1))
    assert tuple(a.shape) == (1, 1, 2, 4) and tuple(b.shape) == (1, 1, 1, 8)


def test_negative_tokens_are_refused_instead_of_wrapping(ttnn):
    """uint32 staging would turn -1 into 4294967295; it raises a PrefillInputError naming tokens."""
    with pytest.raises(PrefillInputError, match=r"tokens\[0, 2\]=-1") as info:
        ttnn_staging.stage_tokens(torch.tensor([[1, 2, -1]]))
    assert info.value.field == "tokens"


def test_int32_vectors_beyond_int32_are_refused_instead_of_wrapping(ttnn):
    """A chunk start past 2**31 - 1 would wrap in int32: it raises a PrefillInputError naming the field."""
    with pytest.raises(PrefillInputError, match=r"start\[1\]=2147483648") as info:
        ttnn_staging.stage_int_vector(torch.tensor([0, 2**31]), name="start")
    assert info.value.field == "start"


def test_top_k_beyond_the_ttnn_sampling_limit_is_refused(ttnn):
    """ttnn.sampling takes k in [1, 32]: a larger top_k names the field."""
    with pytest.raises(PrefillInputError, match="top_k=33") as info:
        ttnn_staging.stage(TOP_K, sampling_values((SamplingParams(top_k=33),))[TOP_K])
    assert info.value.field == "sampling.top_k"


def test_a_spec_outside_the_contract_has_no_staging(ttnn):
    """A tensor spec the contract does not hold is a KeyError naming it, never a guess."""
    bogus = TensorSpec("bogus", Stage.OUTPUT, torch.float32, ("B",), "not in the contract")
    with pytest.raises(KeyError, match="bogus"):
        ttnn_staging.stage(bogus, torch.zeros(2))
