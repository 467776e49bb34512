"""``LaneGroup`` under a careless caller: the forms a runtime takes, named errors for the rest, one call at a time."""

from __future__ import annotations

import threading

import pytest
import torch

from prefill_core import SamplingParams
from prefill_core.values.errors import (
    EmptyBatchError,
    InvalidSamplingError,
    PrefillConfigError,
    PrefillInputError,
    PrefillStateError,
)
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.lanes.group import LaneGroup
from prefill_shell.serving.lane_facade import LaneGroupFacade
from tests.helpers import ParkingModel
from tests.lane_kit import PER_LANE, group_call, lane_runtime, make_group, pool_of

ROWS = [(40, 0, None), (70, 0, None), (30, 0, None)]
SLOTS = (PER_LANE + 1, 0, PER_LANE)  # lane 1, lane 0, lane 1
WAIT = 30  # seconds before a broken thread test gives up instead of hanging


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def call():
    return group_call(ROWS, SLOTS, 2)


def test_one_sampling_params_for_every_row_is_served_as_the_list_of_it(tiny_model, call):
    """sampling=SamplingParams(...) means that value for every row, as on a runtime (it raised a TypeError)."""
    params = SamplingParams(temperature=0.8, top_k=5, seed=3, num_logprobs=2)
    one = make_group(tiny_model, 2).prefill(**(call.kwargs() | {"sampling": params}))
    listed = make_group(tiny_model, 2).prefill(**(call.kwargs() | {"sampling": [params] * len(ROWS)}))
    assert one == listed and [r.row for r in one] == [0, 1, 2]


@pytest.mark.parametrize("field", ["num_logprobs", "prompt_logprobs"])
def test_batched_refuses_one_params_asking_per_row_extras_before_any_lane_runs(tiny_model, call, field):
    """batched=True with one SamplingParams asking top or prompt log-probs is refused by name, as a list of it is."""
    group = make_group(tiny_model, 2)
    before = [pool_of(lane.runtime) for lane in group.lanes]
    params = SamplingParams(**{field: 2})
    with pytest.raises(InvalidSamplingError, match=f"sampling.{field}=2"):
        group.prefill(**(call.kwargs() | {"sampling": params}), batched=True)
    after = [pool_of(lane.runtime) for lane in group.lanes]
    assert all(torch.equal(a, b) for pools in zip(before, after) for a, b in zip(*pools))


@pytest.mark.parametrize(
    "field, value",
    [("slots", torch.tensor(5)), ("prompt_lengths", torch.tensor(40)), ("cached_lengths", 0), ("prompt_lengths", 40)]
    + [("prompt_lengths", torch.tensor([40, 70, 30], device="meta"))],
)
def test_a_per_row_argument_that_is_not_rows_is_named(tiny_model, call, field, value):
    """A 0-d tensor or a number where one entry per row belongs is a PrefillInputError naming the field."""
    with pytest.raises(PrefillInputError, match=f"{field}="):
        make_group(tiny_model, 2).prefill(**(call.kwargs() | {field: value}))


def test_a_call_without_rows_is_an_empty_batch_error(tiny_model):
    """Zero rows is an EmptyBatchError, as on a runtime (it returned an empty list the facade then failed on)."""
    with pytest.raises(EmptyBatchError):
        make_group(tiny_model, 2).prefill(torch.zeros(0, 8, dtype=torch.int64), [], [], slots=[], batched=True)


def _lane1_only(call) -> dict:
    rows = list(call.routes[1].source_rows)
    return dict(
        tokens=call.tokens[rows],
        page_table=call.table[rows],
        prompt_lengths=[call.lengths[r] for r in rows],
        slots=[SLOTS[r] for r in rows],
    )


@pytest.mark.parametrize("entry", ["prefill on an idle lane", "cleanup", "close"])
def test_a_second_thread_is_refused_by_the_group_and_changes_nothing(tiny_model, call, entry):
    """While a call runs lane 0, another thread's call (even one on lane 1 only), cleanup or close is refused."""
    parking = ParkingModel(tiny_model)
    group = LaneGroup([PrefillExecutor(lane_runtime(parking, 0)), PrefillExecutor(lane_runtime(tiny_model, 1))])
    want = make_group(tiny_model, 2).prefill(**call.kwargs())
    second = {
        "prefill on an idle lane": lambda: group.prefill(**_lane1_only(call)),
        "cleanup": group.cleanup,
        "close": group.close,
    }[entry]
    box = {}

    def work():
        parking.parked_thread = threading.get_ident()
        box["out"] = group.prefill(**call.kwargs())

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    parking.barrier.wait()  # the other thread is inside lane 0's model body
    try:
        with pytest.raises(PrefillStateError, match="while a call is in progress"):
            second()
    finally:
        parking.go.set()
        thread.join(WAIT)
    assert box["out"] == want
    assert group.prefill(**call.kwargs()) == want


@pytest.mark.parametrize(
    "build",
    [
        lambda model: LaneGroup(None),
        lambda model: LaneGroup([1, 2]),
        lambda model: LaneGroupFacade(None, max_seq_len=128),
        lambda model: LaneGroupFacade([model, model], max_seq_len=128),
        lambda model: LaneGroupFacade([(model, TorchBackend(), 1)], max_seq_len=128),
        lambda model: LaneGroupFacade([(None, TorchBackend())], max_seq_len=128),
        lambda model: LaneGroupFacade([(model, TorchBackend())], max_seq_len=128, policy="small"),
    ],
    ids=[
        "group of None",
        "group of ints",
        "facade of None",
        "models without backends",
        "triples",
        "None model",
        "policy",
    ],
)
def test_a_lane_group_built_from_what_is_not_lanes_is_a_config_error(tiny_model, build):
    """Lanes that are not executors or (model, backend) pairs, or a policy that is not one, are PrefillConfigErrors."""
    with pytest.raises(PrefillConfigError, match="lane group"):
        build(tiny_model)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [({"vocab_size": 300}, "spec.vocab_size 256 vs 300"), ({"num_layers": 1}, "spec.num_layers 2 vs 1")],
    ids=["vocab", "layers"],
)
def test_lanes_of_different_models_are_refused_by_name_before_anything_runs(tiny_model, overrides, named):
    """A group (and a lane facade) of lanes whose model specs differ names the lane and the field at construction
    (before: rows came back from two models, logits of widths 256 and 300, and batched=True raised torch's stack
    error)."""
    from prefill_shell.reference import random_llama

    other = random_llama(1, "tiny", max_position_embeddings=8192, **overrides)
    with pytest.raises(PrefillConfigError, match=f"lane group: lane 1's model differs from lane 0's \\({named}\\)"):
        LaneGroup([PrefillExecutor(lane_runtime(tiny_model, 0)), PrefillExecutor(lane_runtime(other, 1))])
    with pytest.raises(PrefillConfigError, match=f"lane group facade: lane 1's model differs .*{named}"):
        LaneGroupFacade([(tiny_model, TorchBackend()), (other, TorchBackend())], max_seq_len=128)
