"""``ServingFacade`` under a careless caller: every bad argument is a named error that runs nothing and writes no KV."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_core.values.errors import (
    InvalidPageTableError,
    InvalidSamplingError,
    PrefillConfigError,
    PrefillInputError,
    PrefillStateError,
)
from prefill_shell.backends import TorchBackend
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.plugin_sampling import rows_from_plugin
from tests.helpers import ParkingModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK, POOL = 16, 48
POLICY = PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,))
WAIT = 30  # seconds before a broken thread test gives up instead of hanging


def _facade(model, **kwargs) -> ServingFacade:
    facade = ServingFacade(model, TorchBackend(), max_seq_len=256, max_batch_size=4, policy=POLICY, **kwargs)
    spec = model.spec
    facade.allocate_kv_cache((POOL, spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers)
    return facade


def _pool(facade) -> list[torch.Tensor]:
    return [t.clone() for t in facade.kv.keys + facade.kv.values]


def _unchanged(before, facade) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, _pool(facade)))


@pytest.fixture(scope="module")
def call(kit):
    tokens = kit.token_matrix([kit.make_tokens(64, seed=1), kit.make_tokens(50, seed=2)])
    table = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    return SimpleNamespace(tokens=tokens, table=table, prompt_lens=torch.tensor([64, 50]))


def _forward(facade, call, **kwargs):
    args = dict(tokens=call.tokens, page_table=call.table, enable_trace=False, prompt_lens=call.prompt_lens)
    args.update(kwargs)
    return facade.prefill_forward(args.pop("tokens"), args.pop("page_table"), **args)


def _penalised(**fields):
    """Row 0 carries a repetition penalty (sampled by the facade), row 1 is a plain greedy row."""
    base = dict(temperature=[0.7, 0.0], top_k=[20, 1], top_p=[0.9, 0.0], repetition_penalty=[1.3, 1.0], seed=[5, -1])
    return SimpleNamespace(**(base | fields))


def test_a_zero_d_tokens_tensor_is_a_named_error(tiny_model, call):
    """tokens as a 0-d tensor is the runtime's PrefillInputError naming tokens, not len()'s TypeError."""
    facade = _facade(tiny_model)
    with pytest.raises(PrefillInputError, match="tokens="):
        _forward(facade, call, tokens=torch.tensor(5))


@pytest.mark.parametrize(
    "field, make",
    [
        ("tokens", lambda t: t.to(torch.complex64)),
        ("tokens", lambda t: t.to("meta")),
        ("page_table", lambda t: t.to("meta")),
    ],
    ids=["complex tokens", "meta tokens", "meta int64 page_table"],
)
def test_a_tensor_with_no_dense_integer_data_is_named(tiny_model, call, field, make):
    """Complex tokens (cast silently to their real part before) and meta tensors are named by the runtime."""
    facade = _facade(tiny_model)
    source = call.tokens if field == "tokens" else call.table.to(torch.int64)
    with pytest.raises(PrefillInputError, match=f"{field}=<tensor"):
        _forward(facade, call, **{field: make(source)})


@pytest.mark.parametrize("block", [2**32, 2**40, 2**63 - 1])
def test_an_int64_block_id_past_int32_is_refused_not_wrapped_onto_another_block(tiny_model, call, block):
    """An int64 page table is not cast to int32 when that would wrap an id onto a real block: the id is named."""
    facade = _facade(tiny_model)
    before = _pool(facade)
    table = call.table.to(torch.int64)
    table[0, 3] = block
    with pytest.raises(InvalidPageTableError, match=f"blocks\\[3\\]={block} "):
        _forward(facade, call, page_table=table)
    assert _unchanged(before, facade)


@pytest.mark.parametrize(
    "field, bad",
    [
        ("temperature", [float("nan"), 0.0]),
        ("temperature", [-1.0, 0.0]),
        ("top_p", [2.0, 0.0]),
        ("seed", [2**70, -1]),
    ],
)
def test_a_penalised_rows_sampling_values_are_judged_before_anything_runs(tiny_model, call, field, bad):
    """A row the facade samples itself (penalties) gets the core's sampling rules: named at its row, no KV written."""
    facade = _facade(tiny_model)
    before = _pool(facade)
    with pytest.raises(InvalidSamplingError, match=f"row 0: sampling.{field}="):
        _forward(facade, call, sampling_params=_penalised(**{field: bad}))
    assert _unchanged(before, facade)
    tokens, _ = _forward(facade, call, sampling_params=_penalised())
    assert tokens.shape == (2,)


@pytest.mark.parametrize(
    ("output_tokens", "named"),
    [
        ("abc", "output_tokens=str is invalid"),
        ([[1], [2], [3]], "output_tokens has 3 rows"),  # neither 1 row, the call's 2, nor the lane's slots
        ([[1.5, 2.0], [3.0]], "row 0: output_tokens="),
    ],
    ids=["text", "a row count of neither form", "floats"],
)
def test_bad_output_tokens_of_a_penalised_row_are_named_before_anything_runs(tiny_model, call, output_tokens, named):
    """output_tokens giving a penalised row no integer ids, or rows in no form: an InvalidSamplingError; no KV written.

    One row is a broadcast (tt-transformers' form), no longer a row short."""
    facade = _facade(tiny_model)
    before = _pool(facade)
    sampling = _penalised(repetition_penalty=[1.3, 1.3])
    with pytest.raises(InvalidSamplingError, match=named):
        _forward(facade, call, sampling_params=sampling, output_tokens=output_tokens)
    assert _unchanged(before, facade)


@pytest.mark.parametrize("field", ["prompt_tokens", "output_tokens"])
@pytest.mark.parametrize("offset", [1, 1000], ids=["vocab+1", "vocab+1000"])
def test_a_penalised_rows_ids_past_the_vocabulary_are_named_before_any_kv_write(tiny_model, call, field, offset):
    """An id above vLLM's pad (the vocabulary size) is named at its row and field, the pool unchanged.

    Before: prompt_tokens raised a raw IndexError after the KV pool was written; output_tokens ignored the id."""
    facade = _facade(tiny_model)
    before = _pool(facade)
    bad = tiny_model.spec.vocab_size + offset
    state = {field: [[3, bad, 4], [5]]}
    with pytest.raises(InvalidSamplingError, match=f"row 0: {field} holds id {bad}, which is invalid") as caught:
        _forward(facade, call, sampling_params=_penalised(), **state)
    assert (caught.value.row, caught.value.field) == (0, field)
    assert _unchanged(before, facade)


@pytest.mark.parametrize("field", ["prompt_tokens", "output_tokens"])
def test_a_penalised_rows_negative_id_other_than_minus_one_is_named(tiny_model, call, field):
    """-1 is padding (tt-transformers, vLLM); -2 is no sender's pad: named at its row, the pool unchanged."""
    facade = _facade(tiny_model)
    before = _pool(facade)
    with pytest.raises(InvalidSamplingError, match=f"row 0: {field} holds id -2"):
        _forward(facade, call, sampling_params=_penalised(), **{field: [[3, -1, -2], [5]]})
    assert _unchanged(before, facade)


def test_enable_log_probs_other_than_a_bool_is_named_at_its_row():
    """enable_log_probs='no' is refused at its row, never read as truthy (a log-prob the row did not ask for)."""
    sampling = SimpleNamespace(temperature=0.0, top_k=1, top_p=0.0, num_logprobs=0, enable_log_probs=[True, "no"])
    with pytest.raises(InvalidSamplingError, match="row 1: sampling_params.enable_log_probs='no'"):
        rows_from_plugin(sampling, 2, 256)


def test_a_kv_cache_shape_that_is_not_a_sequence_is_a_config_error(tiny_model):
    """allocate_kv_cache(48, ...) names the shape, where tuple(48) raised a TypeError."""
    facade = ServingFacade(tiny_model, TorchBackend(), max_seq_len=256, policy=POLICY)
    with pytest.raises(PrefillConfigError, match="kv_cache_shape=\\(48,\\)"):
        facade.allocate_kv_cache(48, tiny_model.dtype, tiny_model.spec.num_layers)


@pytest.mark.parametrize("name, value", [("max_seq_len", None), ("max_batch_size", 2.5), ("max_batch_size", 0)])
def test_the_facades_sizes_must_be_positive_ints(tiny_model, name, value):
    """A max_seq_len or max_batch_size that is not an int > 0 is a PrefillConfigError at construction."""
    sizes = dict(max_seq_len=256, max_batch_size=4) | {name: value}
    with pytest.raises(PrefillConfigError, match=f"{name}={value!r}"):
        ServingFacade(tiny_model, TorchBackend(), policy=POLICY, **sizes)


@pytest.mark.parametrize("entry", ["cleanup", "allocate_kv_cache"])
def test_a_teardown_from_another_thread_during_a_call_is_refused_and_changes_nothing(tiny_model, call, entry):
    """cleanup/allocate_kv_cache while another thread's call runs raise PrefillStateError; the facade still serves."""
    parking = ParkingModel(tiny_model)
    facade = _facade(parking)
    want = _forward(_facade(tiny_model), call)
    box = {}

    def work():
        parking.parked_thread = threading.get_ident()
        box["out"] = _forward(facade, call)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    parking.barrier.wait()  # the other thread is inside a model body call
    try:
        with pytest.raises(PrefillStateError, match="while a call is in progress"):
            getattr(facade, entry)()
    finally:
        parking.go.set()
        thread.join(WAIT)
    assert torch.equal(box["out"], want)
    assert torch.equal(_forward(facade, call), want)


@pytest.mark.parametrize(("other", "num_logprobs"), [(-2, 0.0), (0, -2.0), (-2, False), (-2, 0.5)])
def test_num_logprobs_other_than_the_plugins_ints_is_named_at_its_row(other, num_logprobs):
    """-2 and 0 are ints in the plugin's encoding: 0.0, -2.0, False and 0.5 are refused at their row, not read as them.

    (Beside an equal int in every other row, a float or bool is one value held by every row: read as that int.)
    """
    sampling = SimpleNamespace(temperature=0.0, top_k=1, top_p=0.0, num_logprobs=[other, num_logprobs])
    with pytest.raises(InvalidSamplingError, match=r"row 1: sampling_params\.num_logprobs="):
        rows_from_plugin(sampling, 2, 256)


def test_can_sample_on_device_must_be_a_bool(tiny_model):
    """Warm-up reads can_sample_on_device as the plugin sends it, a bool; "yes" is a TypeError, as enable_trace's."""
    facade = _facade(tiny_model)
    with pytest.raises(TypeError, match="can_sample_on_device must be bool"):
        facade.warmup_model_prefill(kv_cache=facade.kv, can_sample_on_device="yes", enable_trace=False)


def test_a_failed_pool_build_says_the_old_pool_is_gone_and_the_next_allocation_serves(tiny_model, call):
    """A pool the factory cannot build (out of memory) raises its own error with a note that the previous pool
    was released; the facade then refuses calls by name until allocate_kv_cache succeeds again."""
    fail = {"now": False}

    def factory(num_blocks, block_size):
        if fail["now"]:
            raise MemoryError("no room for the pool")
        return tiny_model.new_kv_cache(num_blocks, block_size)

    facade = _facade(tiny_model, kv_factory=factory)
    want = _forward(facade, call, kv_cache=facade.kv)
    spec = tiny_model.spec
    shape = (POOL, spec.num_kv_heads, BLOCK, spec.head_dim)
    fail["now"] = True
    with pytest.raises(MemoryError) as raised:
        facade.allocate_kv_cache(shape, tiny_model.dtype, spec.num_layers)
    assert any("released the previous KV pool" in note for note in getattr(raised.value, "__notes__", []))
    with pytest.raises(PrefillStateError, match="call allocate_kv_cache"):
        _forward(facade, call)
    fail["now"] = False
    kv = facade.allocate_kv_cache(shape, tiny_model.dtype, spec.num_layers)
    assert torch.equal(_forward(facade, call, kv_cache=kv), want)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, "bfloat16"])
def test_a_kv_dtype_other_than_the_models_is_refused_by_name_at_construction(tiny_model, kv_dtype):
    """ServingFacade and LaneGroupFacade refuse kv_dtype != the model's dtype before any pool exists (before: the
    facade accepted allocate_kv_cache(shape, bfloat16, L), returned a float32 pool, and refused float32 by name)."""
    from prefill_shell.serving.lane_facade import LaneGroupFacade

    with pytest.raises(PrefillConfigError, match="ServingFacade: kv_dtype=.* is invalid: must be None or the model's"):
        ServingFacade(tiny_model, TorchBackend(), max_seq_len=256, kv_dtype=kv_dtype)
    with pytest.raises(PrefillConfigError, match="LaneGroupFacade: kv_dtype="):
        LaneGroupFacade([(tiny_model, TorchBackend())], max_seq_len=256, kv_dtype=kv_dtype)


def test_the_models_own_kv_dtype_builds_its_pool_in_it(tiny_model):
    """kv_dtype equal to the model's dtype is honoured: allocate_kv_cache in it returns a pool of that dtype."""
    facade = _facade(tiny_model, kv_dtype=tiny_model.dtype)
    assert facade.kv.dtype == tiny_model.dtype
