"""``ServingFacade.can_trace``: tt-transformers' static question: geometry only, False on bad input."""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, can_trace
from prefill_shell.backends import TorchBackend
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.lane_facade import LaneGroupFacade

BLOCK = 16
POLICY = PrefillPolicy(length_ladder=(128, 256), max_chunk_length=256, chunk_quantum=128, trace_lengths=(128,))


@pytest.fixture(scope="module")
def facade(tiny_model):
    facade = ServingFacade(tiny_model, TorchBackend(), max_seq_len=512, max_batch_size=4, policy=POLICY)
    spec = tiny_model.spec
    facade.allocate_kv_cache((64, spec.num_kv_heads, BLOCK, spec.head_dim), tiny_model.dtype, spec.num_layers)
    yield facade
    facade.cleanup()


def _tokens(rows: int, width: int) -> torch.Tensor:
    return torch.ones(rows, width, dtype=torch.int64)


def test_rows_whose_steps_are_trace_lengths_can_trace(facade):
    """Two rows of <= 128 tokens (one 128 step each) and a cached row whose work is one 128 step: True."""
    assert facade.can_trace(tokens=_tokens(2, 100), prompt_lens=torch.tensor([100, 60]))
    assert facade.can_trace(tokens=_tokens(1, 300), prompt_lens=[300], start_pos=torch.tensor([256]))


def test_a_row_whose_step_is_not_a_trace_length_cannot(facade):
    """A 200-token uncached row runs one 256 step, which the policy does not trace: False."""
    assert not facade.can_trace(tokens=_tokens(2, 200), prompt_lens=[200, 10])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tokens=torch.ones(0, 8, dtype=torch.int64)),
        dict(tokens=torch.ones(8, dtype=torch.int64)),
        dict(tokens=torch.ones(1, 8)),
        dict(tokens="abc"),
        dict(tokens=_tokens(2, 8), prompt_lens=[8]),
        dict(tokens=_tokens(1, 8), prompt_lens=[9]),
        dict(tokens=_tokens(1, 8), prompt_lens=torch.tensor([8.0])),
        dict(tokens=_tokens(1, 8), start_pos=[-1]),
        dict(tokens=_tokens(1, 8), prompt_lens=[4], start_pos=[5]),
        dict(tokens=_tokens(1, 8), prompt_lens=[0]),
        dict(tokens=_tokens(1, 1024), prompt_lens=[1024]),
    ],
)
def test_bad_input_is_false_not_an_error(facade, kwargs):
    """No rows, 1-D or float tokens, wrong counts, lengths past the width or the capacity, bad offsets: False."""
    assert facade.can_trace(**kwargs) is False


def test_it_is_false_before_a_pool_and_with_traces_off(tiny_model):
    """Without a pool, or with prefill traces off, nothing can trace."""
    assert not ServingFacade(tiny_model, TorchBackend(), max_seq_len=512).can_trace(tokens=_tokens(1, 8))
    off = ServingFacade(tiny_model, TorchBackend(), max_seq_len=512, prefill_traces=False)
    off.allocate_kv_cache()
    assert not off.can_trace(tokens=_tokens(1, 8))
    off.cleanup()


def test_the_core_question_needs_no_tensors():
    """prefill_core.can_trace answers from lengths alone; a fully cached row is plannable, so it may trace."""
    layout = PageTableLayout(BLOCK, 32, 64)
    assert can_trace([128, 64], [128, 0], POLICY, layout)
    assert not can_trace([], [], POLICY, layout) and not can_trace([10], [True], POLICY, layout)


def test_a_lane_group_answers_for_its_lanes(tiny_model):
    """LaneGroupFacade asks every lane's policy and layout: False before its pools, then the same answer."""
    group = LaneGroupFacade(
        [(tiny_model, TorchBackend()), (tiny_model, TorchBackend())], max_seq_len=512, policy=POLICY
    )
    assert not group.can_trace(tokens=_tokens(1, 100))
    group.allocate_kv_cache()
    assert group.can_trace(tokens=_tokens(2, 100)) and not group.can_trace(tokens=_tokens(2, 200))
    group.cleanup()
