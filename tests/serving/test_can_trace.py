"""``ServingFacade.can_trace``: whether a traced call of this geometry replays on what the lane warmed up.

Geometry only, False on bad input; planned by ``prefill_core.plan_call``, the
function the traced call plans with, so the two cannot disagree (the property
below runs both)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefill_core import PageTableLayout, PrefillPolicy, can_trace
from prefill_core.values.errors import TraceCoverageError
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
    facade.warmup_model_prefill(kv_cache=facade.kv, can_sample_on_device=False, enable_trace=True)
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


def test_it_is_false_before_a_pool_a_warm_up_and_with_traces_off(tiny_model):
    """Without a pool, before a traced warm-up, or with prefill traces off, nothing can trace."""
    assert not ServingFacade(tiny_model, TorchBackend(), max_seq_len=512).can_trace(tokens=_tokens(1, 8))
    cold = ServingFacade(tiny_model, TorchBackend(), max_seq_len=512, policy=POLICY)
    cold.allocate_kv_cache()
    assert not cold.can_trace(tokens=_tokens(1, 8))  # nothing captured: a traced call would be refused
    cold.cleanup()
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
    group.warmup_model_prefill(kv_cache=group.kv, can_sample_on_device=False, enable_trace=True)
    assert group.can_trace(tokens=_tokens(2, 100)) and not group.can_trace(tokens=_tokens(2, 200))
    group.cleanup()


WARM_POLICY = PrefillPolicy(length_ladder=(32, 64, 128), max_chunk_length=128, chunk_quantum=64, waves=(1, 2, 4))


@pytest.fixture(scope="module")
def warmed(tiny_model):
    """One facade per warm-up (the lengths it captured), built once each."""
    made = {}
    spec = tiny_model.spec
    for lengths in ((32,), (64,), (128,), (32, 128), None):
        facade = ServingFacade(
            tiny_model, TorchBackend(), max_seq_len=256, max_batch_size=4, policy=WARM_POLICY, warmup_lengths=lengths
        )
        facade.allocate_kv_cache((64, spec.num_kv_heads, BLOCK, spec.head_dim), tiny_model.dtype, spec.num_layers)
        facade.warmup_model_prefill(kv_cache=facade.kv, can_sample_on_device=False, enable_trace=True)
        made[lengths] = facade
    yield made
    for facade in made.values():
        facade.cleanup()


@st.composite
def _calls(draw):
    rows = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 200), min_size=rows, max_size=rows))
    cached = [draw(st.sampled_from([c for c in (0, 16, 32, 64, 128) if c <= n])) for n in lengths]
    warm_up = draw(st.sampled_from([(32,), (64,), (128,), (32, 128), None]))
    return lengths, cached, warm_up


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=_calls())
def test_can_trace_is_true_exactly_when_the_traced_call_runs(warmed, call):
    """Over random rows and warm-ups: can_trace(x) is True iff prefill_forward(x, enable_trace=True) runs
    (a False is a TraceCoverageError before anything runs). Once, a 200-token row after
    warmup_lengths=(128,) was vouched for, and its traced call refused."""
    lengths, cached, warm_up = call
    facade = warmed[warm_up]
    width = max(lengths)
    tokens = torch.ones(len(lengths), width, dtype=torch.int64)
    blocks, table = 0, torch.full((len(lengths), width // BLOCK + 1), -1, dtype=torch.int32)
    for row, n in enumerate(lengths):
        need = -(-n // BLOCK)
        table[row, :need] = torch.arange(blocks + 1, blocks + 1 + need)
        blocks += need
    asked = facade.can_trace(tokens=tokens, prompt_lens=lengths, start_pos=cached)
    try:
        facade.prefill_forward(
            tokens, table, enable_trace=True, prompt_lens=lengths, start_pos=cached, kv_cache=facade.kv
        )
        ran = True
    except TraceCoverageError:
        ran = False
    assert asked == ran
