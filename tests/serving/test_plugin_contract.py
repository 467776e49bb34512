"""``ServingFacade`` fed exactly the objects vLLM's Tenstorrent plugin builds (numpy lengths, int32 tensors, lists)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_core.errors import PrefillConfigError, PrefillInputError
from prefill_shell.backends import TorchBackend
from prefill_shell.serving.facade import ServingFacade

BLOCK, POOL = 16, 48
POLICY = PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,))
LENGTHS, STARTS = [120, 70], [0, 37]
"""A chunked step as the plugin sends it: row 1 resumes inside a block (tokens already computed: 37)."""


def _facade(model) -> ServingFacade:
    facade = ServingFacade(model, TorchBackend(), max_seq_len=256, max_batch_size=4, policy=POLICY)
    spec = model.spec
    facade.allocate_kv_cache((POOL, spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers)
    return facade


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
