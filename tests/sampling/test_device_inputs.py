"""Device sampling inputs K, P, T on the torch backend: exact host values, workspace refresh, traced == eager."""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams, SamplingPath, WarmupManifest
from prefill_shell.backends import TorchBackend
from prefill_shell.device.contract import (
    LAST_TOKEN_INDEX,
    SAMPLING_INPUTS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    sampling_values,
    workspace_specs,
)
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference import random_llama
from prefill_shell.sampling.torch_sampling import sample_row
from tests.helpers import CHUNK_256_POLICY, build_runtime

FIRST = SamplingParams(temperature=0.9, top_k=8, top_p=0.9, seed=5, num_logprobs=2)
SECOND = SamplingParams(temperature=0.45, top_k=3, top_p=0.95, seed=6, num_logprobs=2)


@pytest.fixture(scope="module")
def executor():
    model = random_llama(0, "tiny")
    executor = PrefillExecutor(build_runtime(model, num_blocks=64, block_size=32, policy=CHUNK_256_POLICY))
    yield executor
    executor.close()


def _args(sampling, rows: int = 3, seed: int = 1) -> dict:
    tokens = torch.randint(1, 256, (rows, 100), generator=torch.Generator().manual_seed(seed))
    table = torch.arange(rows * 4, dtype=torch.int32).reshape(rows, 4)
    return dict(
        tokens=tokens,
        page_table=table,
        prompt_lengths=[100] * rows,
        sampling=sampling if isinstance(sampling, list) else [sampling] * rows,
    )


@pytest.mark.parametrize("temperature", [0.9, 0.45, 0.95, 1e-5, 1e308])
def test_host_values_hold_each_rows_parameters_bit_for_bit(temperature):
    """K, P and T keep a row's own values exactly, even where 1/(1/T) != T or P underflows float32."""
    params = SamplingParams(temperature=temperature, top_k=7, top_p=1e-46)
    values = sampling_values((params, params))
    assert values[TEMPERATURE].tolist() == [temperature] * 2
    assert values[TOP_P].tolist() == [1e-46] * 2 and values[TOP_K].tolist() == [7, 7]
    assert all(values[spec].dtype == spec.host_dtype for spec in SAMPLING_INPUTS)


def test_greedy_rows_hold_the_greedy_triple():
    """A greedy row (T below the threshold, or top_k 1) holds K=1, P=1, T=1 beside a sampled row's values."""
    rows = (
        SamplingParams(temperature=1e-39, top_k=20, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=0.7, top_k=4, top_p=0.8),
    )
    values = sampling_values(rows)
    assert [values[spec].tolist() for spec in SAMPLING_INPUTS] == [[1, 1, 4], [1.0, 1.0, 0.8], [1.0, 1.0, 0.7]]


def test_torch_backend_samples_what_host_sampling_samples_from_the_tensors():
    """TorchBackend.sample on the K/P/T tensors gives every row sample_row's token for the row's own params."""
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t, k, p in ((0.9, 20, 0.9), (0.45, 5, 1.0), (0.95, 100, 0.5), (1e308, 3, 1.0))
    ]
    seeds = (11, 12, 13, 14)
    values = sampling_values(params)
    tokens = TorchBackend().sample(logits, values, seeds)
    want = [int(sample_row(logits[b], p.top_k, p.top_p, p.temperature, seeds[b])) for b, p in enumerate(params)]
    assert tokens.tolist() == want


def test_workspaces_hold_k_p_t_only_for_top_k_programs(executor):
    """A top-k alias's workspace holds SAMPLING_INPUTS after the last-token index; logits and argmax ones do not."""
    for sampling, path in (
        (None, SamplingPath.LOGITS),
        (SamplingParams.greedy(), SamplingPath.ARGMAX),
        (FIRST, SamplingPath.TOPK),
    ):
        (prepared,) = executor.runtime.prepare(**_args(sampling)).requests
        specs = workspace_specs(prepared.program_signature)
        assert prepared.sampling_path is path and specs[0] is LAST_TOKEN_INDEX
        assert sum(spec in SAMPLING_INPUTS for spec in specs) == (3 if path is SamplingPath.TOPK else 0)
        assert (specs[1:4] == SAMPLING_INPUTS) == (path is SamplingPath.TOPK)


def test_traced_top_k_refreshes_the_workspace_in_place_and_equals_eager(executor):
    """Traced calls with other params reuse the same K/P/T tensors, allocate nothing, hold the last call's values."""
    runtime = executor.runtime
    executor.warm_up(WarmupManifest().observe(runtime.prepare(**_args(FIRST)).requests))
    ledger = runtime.backend.ledger
    warm = {h.spec: h for h in ledger.live() if h.spec in SAMPLING_INPUTS}
    assert set(warm) == set(SAMPLING_INPUTS) and {h.ownership for h in warm.values()} == {Ownership.WORKSPACE}
    storage = {spec: h.value.data_ptr() for spec, h in warm.items()}
    before = (ledger.allocations, sorted(h.id for h in ledger.live()))
    waves = (FIRST, SECOND, [SECOND, SamplingParams.greedy(num_logprobs=1), FIRST])
    traced = [executor.prefill(**_args(sampling, seed=2), mode="traced") for sampling in waves]
    assert (ledger.allocations, sorted(h.id for h in ledger.live())) == before
    assert {h.spec: h for h in ledger.live() if h.spec in SAMPLING_INPUTS} == warm
    assert {spec: h.value.data_ptr() for spec, h in warm.items()} == storage
    want = sampling_values((*waves[-1], waves[-1][0]))  # the padding row repeats row 0
    assert all(torch.equal(warm[spec].value, want[spec]) for spec in SAMPLING_INPUTS)
    assert traced == [executor.prefill(**_args(sampling, seed=2), mode="eager") for sampling in waves]


class KeyRecordingBackend(TorchBackend):
    """A torch backend that records, per ``sample`` call, the host values it got under each key."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def sample(self, logits, inputs, seeds):
        self.calls.append({spec: inputs[spec].tolist() for spec in inputs})
        return super().sample(logits, inputs, seeds)


@pytest.mark.parametrize("traced", [False, True])
def test_every_sampling_input_reaches_backend_sample_by_key_and_has_a_ttnn_staging(traced):
    """Backend.sample gets exactly SAMPLING_INPUTS by key, with each row's exact values; each has a ttnn staging."""
    from prefill_shell.tt import staging as ttnn_staging

    model = random_llama(0, "tiny")
    backend = KeyRecordingBackend()
    runtime = build_runtime(model, num_blocks=64, block_size=32, policy=CHUNK_256_POLICY, backend=backend)
    executor = PrefillExecutor(runtime)
    args = _args([FIRST, SECOND, FIRST])
    executor.warm_up(WarmupManifest().observe(runtime.prepare(**args).requests))
    backend.calls.clear()
    executor.prefill(**args, mode="traced" if traced else "eager")
    (call,) = backend.calls
    want = sampling_values((FIRST, SECOND, FIRST, FIRST))  # the padding row repeats row 0
    assert set(call) == set(SAMPLING_INPUTS)
    assert all(call[spec] == want[spec].tolist() for spec in SAMPLING_INPUTS)
    assert call[TEMPERATURE] == [0.9, 0.45, 0.9, 0.9]  # exact: 0.45 is a double whose 1/(1/T) is not T
    for spec in SAMPLING_INPUTS:
        assert ttnn_staging.contract_of(spec).layout == "ROW_MAJOR"
    executor.close()


def test_torch_backend_sample_reads_its_inputs_by_key_not_by_order():
    """The same mapping in reverse insertion order samples the same tokens: nothing depends on position."""
    logits = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * 3
    values = sampling_values((FIRST, SECOND, SECOND))
    reordered = dict(reversed(list(values.items())))
    backend = TorchBackend()
    assert list(reordered) != list(values)
    assert torch.equal(backend.sample(logits, reordered, (1, 2, 3)), backend.sample(logits, values, (1, 2, 3)))
