"""Penalty state in tt-transformers' forms: rows by slot, by call row, or one broadcast; ``slot_remap`` checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_core.values.errors import InvalidSamplingError
from prefill_shell.backends import TorchBackend
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.penalty_state import check_slot_remap, state_rows
from tests.helpers import make_tokens, page_table, token_matrix

CAPACITY = 4
POLICY = PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,))
PENALISED = dict(temperature=[0.8, 0.8], top_k=[10, 10], top_p=[1.0, 1.0], seed=[3, 4], repetition_penalty=[1.7, 1.7])


def test_state_rows_are_read_by_slot_by_row_or_broadcast():
    """4 rows (the lane's slots) are read at each row's slot; 2 (the call's rows) in order; 1 for every row."""
    lane = torch.arange(4).unsqueeze(1) * 10  # [4, 1]: slot s holds 10 * s
    assert [int(r) for r in state_rows(lane, "prompt_tokens", [3, 1], CAPACITY)] == [30, 10]
    assert [int(r) for r in state_rows(lane[:2], "prompt_tokens", [3, 1], CAPACITY)] == [0, 10]
    assert state_rows([[7, 8]], "output_tokens", [3, 1], CAPACITY) == [[7, 8], [7, 8]]
    assert state_rows(None, "output_tokens", [0], CAPACITY) is None


def test_state_rows_of_another_count_are_named():
    """Three rows for a two-row call in a four-slot lane: an InvalidSamplingError naming the field."""
    with pytest.raises(InvalidSamplingError, match="output_tokens has 3 rows") as caught:
        state_rows([[1], [2], [3]], "output_tokens", [0, 1], CAPACITY)
    assert caught.value.field == "output_tokens"


@pytest.mark.parametrize(
    ("remap", "rule"),
    [([0, 1, 2], "one int per slot"), ([0, 1, 2, 4], r"\[0, 4\)"), ([1, 0, 0, 3], "two slots"), ("0123", "one int")],
)
def test_a_bad_slot_remap_is_named(remap, rule):
    """Wrong length, a slot outside the lane, one slot moved twice, not ints: named; a permutation passes."""
    with pytest.raises(InvalidSamplingError, match=rule):
        check_slot_remap(remap, CAPACITY)
    check_slot_remap(torch.tensor([1, 0, 2, 3]), CAPACITY)


@pytest.fixture(scope="module")
def facade(tiny_model):
    facade = ServingFacade(tiny_model, TorchBackend(), max_seq_len=256, max_batch_size=CAPACITY, policy=POLICY)
    spec = tiny_model.spec
    facade.allocate_kv_cache((48, spec.num_kv_heads, 16, spec.head_dim), tiny_model.dtype, spec.num_layers)
    yield facade
    facade.cleanup()


def _call(facade, **state):
    rows = [make_tokens(40, seed=1), make_tokens(30, seed=2)]
    tokens = token_matrix(rows)
    table = page_table([[4, 5, 6], [7, 8]])
    sampling = SimpleNamespace(**PENALISED)
    out, _ = facade.prefill_forward(
        tokens,
        table,
        enable_trace=False,
        prompt_lens=torch.tensor([40, 30]),
        empty_slots=[2, 0],
        sampling_params=sampling,
        **state,
    )
    return out, rows


def test_penalised_rows_read_their_prompt_and_output_state_in_every_form(facade):
    """prompt_tokens defaults to the prefill tokens; by slot, by row and padded with -1 it samples the same tokens."""
    default, rows = _call(facade)
    padded = token_matrix(rows, 48).masked_fill(token_matrix(rows, 48) == 0, -1)
    by_row, _ = _call(facade, prompt_tokens=padded)
    lane = torch.full((CAPACITY, 48), -1, dtype=torch.int64)
    lane[2], lane[0] = padded[0], padded[1]
    by_slot, _ = _call(facade, prompt_tokens=lane, slot_remap=[0, 1, 2, 3])
    assert torch.equal(default, by_row) and torch.equal(default, by_slot)
    same = [[int(default[0])] * 5]
    by_row, _ = _call(facade, output_tokens=same * 2)
    broadcast, _ = _call(facade, output_tokens=same)
    by_slot, _ = _call(facade, output_tokens=torch.tensor(same * CAPACITY))
    assert torch.equal(by_row, broadcast) and torch.equal(by_row, by_slot)


def test_penalty_state_of_a_wrong_row_count_is_named(facade):
    """prompt_tokens with 3 rows for a 2-row call in a 4-slot lane: an InvalidSamplingError naming it."""
    with pytest.raises(InvalidSamplingError, match="prompt_tokens has 3 rows"):
        _call(facade, prompt_tokens=torch.zeros(3, 4, dtype=torch.int64))


def test_ids_padded_with_vllms_pad_value_sample_as_unpadded(facade):
    """vLLM pads prompt_tokens and output_tokens with the vocabulary size: dropped as padding, the same tokens."""
    vocab = facade.model.spec.vocab_size
    default, rows = _call(facade)
    padded = token_matrix(rows, 48).masked_fill(token_matrix(rows, 48) == 0, vocab)
    by_vllm_pad, _ = _call(facade, prompt_tokens=padded)
    assert torch.equal(default, by_vllm_pad)
    outputs = [[int(default[0])] * 3, [int(default[1])]]
    unpadded, _ = _call(facade, output_tokens=outputs)
    padded_outputs, _ = _call(facade, output_tokens=[outputs[0], outputs[1] + [vocab, vocab]])
    minus_one, _ = _call(facade, output_tokens=[outputs[0] + [-1], outputs[1] + [-1, -1]])
    assert torch.equal(unpadded, padded_outputs) and torch.equal(unpadded, minus_one)
