"""``ServingFacade.prefill_forward`` called exactly as vLLM's Tenstorrent plugin calls it: keywords, refusals.

The last section feeds it exactly the objects the plugin builds: numpy lengths, int32 tensors and lists,
vLLM's greedy encodings, its KV shape per device, and the two-phase warm-up before traced steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefill_core import PrefillPolicy, SamplingParams
from prefill_core.values.errors import (
    InvalidSamplingError,
    KVCacheMismatchError,
    PrefillConfigError,
    PrefillInputError,
    PrefillStateError,
    TraceCoverageError,
)
from prefill_shell.backends import TorchBackend
from prefill_shell.serving.facade import ServingFacade

BLOCK = 16
POLICY = PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,))
PLUGIN_EXTRAS = dict(
    page_tables_per_layer=None, prompt_tokens=None, output_tokens=None, slot_remap=None, rope_deltas_all_users=None
)


def _facade(model, **kwargs) -> ServingFacade:
    facade = ServingFacade(model, TorchBackend(), max_seq_len=256, max_batch_size=4, policy=POLICY, **kwargs)
    spec = model.spec
    facade.allocate_kv_cache((48, spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers)
    return facade


@pytest.fixture(scope="module")
def call(kit):
    """Two rows as the plugin sends a chunked step: full token rows, start_pos inside a block, empty_slots."""
    tokens = kit.token_matrix([kit.make_tokens(120, seed=1), kit.make_tokens(90, seed=2)])
    table = kit.page_table(kit.assign_blocks([120, 90], BLOCK, 48, seed=3))
    return dict(tokens=tokens, page_table=table, prompt_lens=torch.tensor([120, 70]), start_pos=torch.tensor([0, 37]))


def _plugin_sampling(**fields):
    base = dict(
        temperature=[0.0, 0.0],
        top_k=[1, 1],
        top_p=[0.0, 0.0],
        presence_penalty=[0.0, 0.0],
        frequency_penalty=[0.0, 0.0],
        repetition_penalty=[1.0, 1.0],
        seed=[-1, -1],
        num_logprobs=[-2, -2],
        enable_log_probs=None,
    )
    return SimpleNamespace(**(base | fields))


def test_model_capabilities_are_read_from_the_class():
    """The plugin reads model_capabilities from the class: chunked prefill and prefix caching are advertised."""
    caps = ServingFacade.model_capabilities
    assert caps["supports_chunked_prefill"] and caps["supports_prefix_caching"] and caps["accepts_trace_mode"]


def test_the_plugins_keyword_set_returns_logits_of_a_prefill_of_each_chunk(tiny_model, kit, call):
    """Every keyword the plugin passes (dropped ones included) is accepted; logits are float32 [B, 1, vocab]."""
    facade = _facade(tiny_model)
    out = facade.prefill_forward(
        call["tokens"].to(torch.int32),  # cast to int64 as the adapter does
        call["page_table"].to(torch.int64),
        kv_cache=facade.kv,
        enable_trace=False,
        prompt_lens=call["prompt_lens"],
        start_pos=torch.tensor([0, 0]),
        empty_slots=[2, 0],
        sampling_params=None,
        **PLUGIN_EXTRAS,
    )
    assert out.shape == (2, 1, tiny_model.spec.vocab_size) and out.dtype == torch.float32
    direct = kit.build_runtime(tiny_model, num_blocks=48, block_size=BLOCK, policy=POLICY)
    expected = direct.prefill(call["tokens"], call["page_table"], [120, 70])
    for row in range(2):
        assert kit.max_abs_diff(out[row, 0], expected[row].logits) <= kit.TOL


def test_an_unknown_keyword_is_a_type_error_naming_it(tiny_model, call):
    """A keyword outside the reviewed set raises TypeError naming it, before anything runs."""
    facade = _facade(tiny_model)
    with pytest.raises(TypeError, match="'pixel_values'"):
        facade.prefill_forward(call["tokens"], call["page_table"], enable_trace=False, pixel_values=None)
    assert facade.runtime.backend.ledger.allocations == 0


def test_per_layer_tables_that_differ_from_page_table_are_refused_by_name_before_any_write(tiny_model, kit, call):
    """A one-group model writes every layer through page_table: per-layer tables equal to it (the plugin's fresh
    padded copies, wider and with more rows) are taken; one layer mapping another block is refused, naming the
    layer, the row and the hybrid facade, with the pool unchanged (it used to be ignored and layer 1's KV written
    through page_table, over blocks another request owns)."""
    facade = _facade(tiny_model)
    layers = tiny_model.spec.num_layers
    table = call["page_table"]
    padded = torch.zeros(4, table.shape[1] + 3, dtype=torch.int32)
    padded[:2, : table.shape[1]] = table
    args = dict(enable_trace=False, kv_cache=facade.kv, prompt_lens=call["prompt_lens"], start_pos=call["start_pos"])
    same = facade.prefill_forward(call["tokens"], table, page_tables_per_layer=[padded.clone()] * layers, **args)
    plain = facade.prefill_forward(call["tokens"], table, **args)
    assert torch.equal(same, plain)
    kit.randomize_pool(facade.kv, seed=4)
    before = [t.clone() for t in facade.kv.keys + facade.kv.values]
    other = [padded.clone() for _ in range(layers)]
    other[1][1, 2] = 47  # row 1's third block (tokens 32..47 of its 70) differs on layer 1
    with pytest.raises(PrefillInputError, match=r"page_tables_per_layer\[1\] row 1.*HybridServingFacade") as raised:
        facade.prefill_forward(call["tokens"], table, page_tables_per_layer=other, **args)
    assert raised.value.field == "page_tables_per_layer[1]" and raised.value.row == 1
    with pytest.raises(PrefillInputError, match="one table per layer"):
        facade.prefill_forward(call["tokens"], table, page_tables_per_layer=other[:1], **args)
    assert all(torch.equal(a, b) for a, b in zip(before, facade.kv.keys + facade.kv.values))


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_enable_trace_must_be_a_bool(tiny_model, call, value):
    """enable_trace is required and must be a bool, as the adapter demands."""
    with pytest.raises(TypeError, match="enable_trace must be bool"):
        _facade(tiny_model).prefill_forward(call["tokens"], call["page_table"], enable_trace=value)


def test_traces_off_refuse_a_traced_call(tiny_model, call):
    """enable_trace=True where prefill traces are off is a ValueError (PrefillConfigError)."""
    with pytest.raises(PrefillConfigError, match="prefill traces are off"):
        _facade(tiny_model, prefill_traces=False).prefill_forward(call["tokens"], call["page_table"], enable_trace=True)


def test_a_traced_call_without_its_trace_runs_nothing(tiny_model, kit, call):
    """A traced call is preflighted whole: TraceCoverageError before any body runs, the pool untouched."""
    facade = _facade(tiny_model)
    kit.randomize_pool(facade.kv, seed=5)
    before = [t.clone() for t in facade.kv.keys + facade.kv.values]
    with pytest.raises(TraceCoverageError):
        facade.prefill_forward(call["tokens"], call["page_table"], enable_trace=True, prompt_lens=call["prompt_lens"])
    assert all(torch.equal(a, b) for a, b in zip(before, facade.kv.keys + facade.kv.values))


def test_another_kv_cache_is_a_named_error(tiny_model, call):
    """kv_cache must be the pool allocate_kv_cache returned."""
    facade = _facade(tiny_model)
    other = tiny_model.new_kv_cache(48, BLOCK)
    with pytest.raises(KVCacheMismatchError, match="kv_cache"):
        facade.prefill_forward(call["tokens"], call["page_table"], enable_trace=False, kv_cache=other)


def test_nothing_runs_before_allocate_kv_cache(tiny_model, call):
    """Before allocate_kv_cache there is no pool: a named state error."""
    facade = ServingFacade(tiny_model, TorchBackend(), max_seq_len=256)
    with pytest.raises(PrefillStateError, match="allocate_kv_cache"):
        facade.prefill_forward(call["tokens"], call["page_table"], enable_trace=False)


def test_allocate_kv_cache_takes_all_three_or_none_and_rebuilds_the_layout(tiny_model):
    """Partial arguments are a TypeError; vLLM's block size replaces the provisional 32; a wrong shape is named."""
    facade = ServingFacade(tiny_model, TorchBackend(), max_seq_len=256, max_batch_size=4)
    spec = tiny_model.spec
    with pytest.raises(TypeError, match="supplied together"):
        facade.allocate_kv_cache((8, spec.num_kv_heads, 16, spec.head_dim))
    assert facade.allocate_kv_cache().block_size == 32 and facade.runtime.config.layout.block_size == 32
    kv = facade.allocate_kv_cache((40, spec.num_kv_heads, 16, spec.head_dim), tiny_model.dtype, spec.num_layers)
    assert (kv.block_size, kv.num_blocks) == (16, 40)
    assert facade.runtime.config.layout.block_size == 16 and facade.runtime.config.kv is kv
    bad = [
        ((40, spec.num_kv_heads, 16), tiny_model.dtype, spec.num_layers, "4 ints"),
        ((40, spec.num_kv_heads + 1, 16, spec.head_dim), tiny_model.dtype, spec.num_layers, "kv_heads"),
        ((40, spec.num_kv_heads, 16, spec.head_dim + 1), tiny_model.dtype, spec.num_layers, "head_dim"),
        ((40, spec.num_kv_heads, 16, spec.head_dim), tiny_model.dtype, spec.num_layers + 1, "num_layers"),
        ((40, spec.num_kv_heads, 16, spec.head_dim), torch.float16, spec.num_layers, "dtype"),
    ]
    for shape, dtype, layers, named in bad:
        with pytest.raises(PrefillConfigError, match=named):
            facade.allocate_kv_cache(shape, dtype, layers)


def test_greedy_rows_sample_the_argmax_and_return_no_log_probs(tiny_model, call):
    """top_k 1 with top_p 0.0 is greedy, never refused; num_logprobs -2 everywhere returns log_probs None."""
    facade = _facade(tiny_model)
    logits = facade.prefill_forward(call["tokens"], call["page_table"], enable_trace=False, **_lens(call))
    tokens, log_probs = facade.prefill_forward(
        call["tokens"], call["page_table"], enable_trace=False, sampling_params=_plugin_sampling(), **_lens(call)
    )
    assert tokens.dtype == torch.int64 and tokens.shape == (2,) and log_probs is None
    assert tokens.tolist() == logits[:, 0].argmax(-1).tolist()


def test_log_probs_are_float32_in_caller_order_with_one_where_none_was_asked(tiny_model, call):
    """num_logprobs 0 returns the sampled token's raw log-prob at that row, 1.0 at a row that asked for none."""
    facade = _facade(tiny_model)
    logits = facade.prefill_forward(call["tokens"], call["page_table"], enable_trace=False, **_lens(call))
    sampling = _plugin_sampling(num_logprobs=torch.tensor([-2, 0]))
    tokens, log_probs = facade.prefill_forward(
        call["tokens"], call["page_table"], enable_trace=False, sampling_params=sampling, **_lens(call)
    )
    assert log_probs.dtype == torch.float32 and log_probs[0].item() == 1.0
    expected = torch.log_softmax(logits[1, 0], -1)[tokens[1]].item()
    assert abs(log_probs[1].item() - expected) <= 1e-5


def _lens(call):
    return dict(prompt_lens=call["prompt_lens"], start_pos=call["start_pos"])


def test_top_k_below_one_is_the_whole_vocabulary_and_seeds_match_the_core(tiny_model, kit, call):
    """top_k <= 0 samples the whole vocabulary (core top_k 0) with the row's seed; scalars, lists, tensors agree."""
    facade = _facade(tiny_model)
    sampling = _plugin_sampling(temperature=0.9, top_k=[0, -5], top_p=1.0, seed=torch.tensor([11, 12]))
    tokens, _ = facade.prefill_forward(
        call["tokens"], call["page_table"], enable_trace=False, sampling_params=sampling, **_lens(call)
    )
    direct = kit.build_runtime(tiny_model, num_blocks=48, block_size=BLOCK, policy=POLICY)
    params = [SamplingParams(0.9, 0, 1.0, seed=11), SamplingParams(0.9, 0, 1.0, seed=12)]
    expected = direct.prefill(call["tokens"], call["page_table"], [120, 70], sampling=params)
    assert tokens.tolist() == [r.token for r in expected]
    scalar = _plugin_sampling(temperature=0.9, top_k=0, top_p=1.0, seed=[11, 12])
    again, _ = _facade(tiny_model).prefill_forward(
        call["tokens"], call["page_table"], enable_trace=False, sampling_params=scalar, **_lens(call)
    )
    assert again.tolist() == tokens.tolist()


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("num_logprobs", [-1, -2], "num_logprobs=-1"),
        ("num_logprobs", [5, -2], "num_logprobs=5"),
        ("repetition_penalty", [1.0, 0.0], "repetition_penalty=0.0"),
        ("presence_penalty", [2.5, 0.0], "presence_penalty=2.5"),
        ("frequency_penalty", [0.0, float("nan")], "frequency_penalty=nan"),
        ("temperature", [-1.0, 0.5], "temperature"),
        ("top_p", [1.0, 1.5], "top_p"),
    ],
)
def test_a_value_nothing_can_honour_is_a_named_error(tiny_model, call, field, value, named):
    """Whole-vocabulary or top-k log-prob lists, penalties outside vLLM's domains, bad floats: InvalidSamplingError."""
    facade = _facade(tiny_model)
    sampling = _plugin_sampling(**(dict(temperature=[0.5, 0.5], top_k=[5, 5], top_p=[1.0, 1.0]) | {field: value}))
    with pytest.raises(InvalidSamplingError, match=named):
        facade.prefill_forward(
            call["tokens"], call["page_table"], enable_trace=False, sampling_params=sampling, **_lens(call)
        )
    assert facade.runtime.backend.ledger.allocations == 0


# ---------------------------------------------------------------- the objects the plugin builds

POOL = 48
LENGTHS, STARTS = [120, 70], [0, 37]
"""A chunked step as the plugin sends it: row 1 resumes inside a block (tokens already computed: 37)."""


@pytest.fixture(scope="module")
def plugin_call(kit):
    """tokens as ``token_ids_cpu_tensor[rows, :max(prompt_lens)]`` (int32) and an int32 block table, as the plugin."""
    tokens = kit.token_matrix([kit.make_tokens(120, seed=1), kit.make_tokens(90, seed=2)])
    table = kit.page_table(kit.assign_blocks([120, 90], BLOCK, POOL, seed=3))
    return dict(tokens=tokens[:, : max(LENGTHS)].to(torch.int32), page_table=table.to(torch.int32))


def _logits(model, call, prompt_lens, start_pos) -> torch.Tensor:
    facade = _facade(model)
    return facade.prefill_forward(
        **call, kv_cache=facade.kv, enable_trace=False, prompt_lens=prompt_lens, start_pos=start_pos, empty_slots=[0, 1]
    )


@pytest.mark.parametrize(
    "start_pos",
    [np.array(STARTS, dtype=np.int32), torch.tensor(STARTS, dtype=torch.int32)],
    ids=["one-process: num_computed_tokens_cpu (numpy int32)", "lanes: torch int32"],
)
def test_numpy_prompt_lens_and_start_pos_equal_the_same_call_with_tensors(tiny_model, plugin_call, start_pos):
    """The plugin's prompt_lens is numpy int64 (start_pos numpy int32 on one process): read as tensors, not refused."""
    expected = _logits(tiny_model, plugin_call, torch.tensor(LENGTHS), torch.tensor(STARTS))
    prompt_lens = np.array(STARTS, dtype=np.int32) + np.array([120, 33], dtype=np.int64)  # computed + this chunk
    out = _logits(tiny_model, plugin_call, prompt_lens, start_pos)
    assert out.shape == (2, 1, tiny_model.spec.vocab_size) and out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_a_reversed_numpy_view_is_read_as_its_values(tiny_model, plugin_call):
    """A numpy view with negative strides (torch cannot wrap it) is still the lengths it holds."""
    expected = _logits(tiny_model, plugin_call, torch.tensor(LENGTHS), None)
    out = _logits(tiny_model, plugin_call, np.array(LENGTHS[::-1])[::-1], None)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("array", [np.array([120.0, 70.0]), np.array([120, 70], dtype=np.uint64)], ids=str)
def test_a_numpy_array_of_another_dtype_is_refused_by_name_before_any_write(tiny_model, plugin_call, kit, array):
    """A float or uint64 numpy array is not cast (the adapter would truncate or wrap it): a named error, no KV write."""
    facade = _facade(tiny_model)
    kit.randomize_pool(facade.kv, seed=9)
    before = [t.clone() for t in facade.kv.keys + facade.kv.values]
    with pytest.raises(PrefillInputError, match="prompt_lengths"):
        facade.prefill_forward(**plugin_call, kv_cache=facade.kv, enable_trace=False, prompt_lens=array)
    assert all(torch.equal(a, b) for a, b in zip(before, facade.kv.keys + facade.kv.values))


def _tolist_sampling(vocab_size: int, num_rows: int) -> SimpleNamespace:
    """``TTSamplingParams`` as ``submit_prefill`` builds it: each field a tensor's ``.tolist()``, seed -1 -> None.

    vLLM sends a greedy request as temperature 0 with top_k 0 and top_p 1.0; the
    plugin's input batch turns top_k 0 into the vocabulary size.
    """
    rows = dict(
        temperature=torch.zeros(num_rows, dtype=torch.float32),
        top_k=torch.full((num_rows,), vocab_size, dtype=torch.int32),
        top_p=torch.ones(num_rows, dtype=torch.float32),
        presence_penalty=torch.zeros(num_rows, dtype=torch.float32),
        frequency_penalty=torch.zeros(num_rows, dtype=torch.float32),
        repetition_penalty=torch.ones(num_rows, dtype=torch.float32),
        seed=torch.full((num_rows,), -1, dtype=torch.int32),
        num_logprobs=torch.tensor([0] + [-2] * (num_rows - 1), dtype=torch.int32),
    )
    rows["enable_log_probs"] = rows["num_logprobs"] >= 0
    fields = {name: value.tolist() for name, value in rows.items()}
    fields["seed"] = [None if seed == -1 else seed for seed in fields["seed"]]
    return SimpleNamespace(**fields)


def test_vllms_greedy_rows_as_the_plugin_encodes_them_take_the_argmax(tiny_model, plugin_call):
    """temperature 0, top_k = vocab, top_p 1.0, seed None: the argmax, with row 0's raw log-prob and 1.0 at row 1."""
    lens = dict(prompt_lens=np.array(LENGTHS), start_pos=np.array(STARTS, dtype=np.int32))
    logits = _logits(tiny_model, plugin_call, **lens)
    facade = _facade(tiny_model)
    sampling = _tolist_sampling(tiny_model.spec.vocab_size, 2)
    tokens, log_probs = facade.prefill_forward(
        **plugin_call, kv_cache=facade.kv, enable_trace=False, empty_slots=[0, 1], sampling_params=sampling, **lens
    )
    assert tokens.dtype == torch.int64 and tokens.tolist() == logits[:, 0].argmax(-1).tolist()
    assert log_probs.dtype == torch.float32 and log_probs.shape == (2,) and log_probs[1].item() == 1.0
    expected = torch.log_softmax(logits[0, 0], -1)[tokens[0]].item()
    assert abs(log_probs[0].item() - expected) <= 1e-5


@pytest.mark.parametrize(("num_devices", "heads"), [(1, 2), (2, 1), (4, 1)])
def test_kv_heads_in_vllms_shape_are_per_device_of_the_lane(tiny_model, num_devices, heads):
    """vLLM divides the KV heads over a lane's devices (never below one): that count is taken, the whole one refused.

    The backend stands for a lane of ``num_devices`` devices by the attribute
    ``TtnnBackend`` sets from its mesh; the tiny model has 2 KV heads.
    """
    backend = TorchBackend()
    backend.num_devices = num_devices
    spec = tiny_model.spec
    facade = ServingFacade(tiny_model, backend, max_seq_len=256, max_batch_size=4, policy=POLICY)
    kv = facade.allocate_kv_cache((POOL, heads, BLOCK, spec.head_dim), tiny_model.dtype, spec.num_layers)
    assert facade.runtime.config.kv is kv
    other = 2 if heads == 1 else 1
    with pytest.raises(PrefillConfigError, match=f"kv_heads={other}"):
        facade.allocate_kv_cache((POOL, other, BLOCK, spec.head_dim), tiny_model.dtype, spec.num_layers)


def test_the_plugins_two_phase_warm_up_then_traced_steps_allocate_nothing(tiny_model, plugin_call):
    """warmup_model: compile (enable_trace=False), then capture (True); traced logits and sampled steps then allocate
    nothing, and a traced step's logits equal an eager one's."""
    facade = _facade(tiny_model)
    for enable_trace in (False, True):
        facade.warmup_model_prefill(kv_cache=facade.kv, can_sample_on_device=True, enable_trace=enable_trace)
    ledger = facade.runtime.backend.ledger
    before = ledger.allocations
    lens = dict(prompt_lens=np.array(LENGTHS), start_pos=np.array(STARTS, dtype=np.int32), empty_slots=[1, 0])
    traced = facade.prefill_forward(**plugin_call, kv_cache=facade.kv, enable_trace=True, **lens)
    sampling = _tolist_sampling(tiny_model.spec.vocab_size, 2)
    tokens, _ = facade.prefill_forward(
        **plugin_call, kv_cache=facade.kv, enable_trace=True, sampling_params=sampling, **lens
    )
    assert ledger.allocations == before
    assert tokens.tolist() == traced[:, 0].argmax(-1).tolist()
    eager = _logits(tiny_model, plugin_call, np.array(LENGTHS), np.array(STARTS, dtype=np.int32))
    assert (traced - eager).abs().max().item() <= 1e-5
