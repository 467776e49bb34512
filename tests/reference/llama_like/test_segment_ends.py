"""``PagedLlama.forward_packed(..., ends_only=True)`` (``device.model.SEGMENT_ENDS_CAPABILITY``): only each
segment's last token's row is computed, and every token's K/V is still written exactly as the full step writes
it; and the runtime asks for it only where nothing reads the other rows."""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams, ceil_div
from prefill_core.values.pooling import PoolingType
from prefill_shell.device.contract import PACKED_INPUTS, PACKED_SEGMENTS
from prefill_shell.device.model import supports_segment_ends
from prefill_shell.reference import random_llama
from prefill_shell.reference.cpu_kernels import library
from prefill_shell.testing.runtime_builder import build_runtime

BS = 16
ROWS = [(200, 0), (37, 0), (150, BS), (2 * BS, 2 * BS), (3 * BS + 5, 2 * BS), (1, 0), (BS + 1, BS)]
"""(length, cached): uncached short and long, cached prefixes, a fully cached row (its re-run writes nothing),
a one-token row."""

MODELS = [
    # "bench": head size 64, the CPU attention kernel's case where it runs; "tiny": torch's attention.
    pytest.param("bench", torch.float32, id="bench-float32"),
    pytest.param(
        "bench",
        torch.bfloat16,
        id="bench-bfloat16",
        marks=pytest.mark.skipif(torch.bfloat16 not in library.kernel_dtypes(), reason="no bfloat16 kernels"),
    ),
    pytest.param("tiny", torch.float32, id="tiny-float32"),
]


class Batch:
    """ROWS over a noise-filled pool, blocks scattered, cached prefixes prefilled; packed steps of 128 tokens."""

    def __init__(self, model, seed: int = 0):
        self.lengths, self.cached = [n for n, _ in ROWS], [c for _, c in ROWS]
        need = [ceil_div(n, BS) for n in self.lengths]
        order = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(seed)).tolist()
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, vocab, (len(ROWS), max(self.lengths)), generator=gen)
        self.table = torch.full((len(ROWS), max(need)), -1, dtype=torch.int32)
        for i, n in enumerate(need):
            self.table[i, :n] = torch.tensor(order[sum(need[:i]) : sum(need[: i + 1])], dtype=torch.int32)
        self.kv = model.new_kv_cache(len(order), BS)
        for pool in self.kv.keys + self.kv.values:
            pool.copy_(torch.randn(pool.shape, generator=gen))
        layout = PageTableLayout(BS, max(need), len(order))
        policy = attrs.evolve(PrefillPolicy(), max_chunk_length=128, packed_steps=True)
        self.runtime = build_runtime(model, kv=self.kv, layout=layout, policy=policy)
        cached = [i for i, c in enumerate(self.cached) if c]
        self.runtime.prefill(self.tokens[cached], self.table[cached], [self.cached[i] for i in cached])


@pytest.mark.parametrize("name, dtype", MODELS)
def test_ends_only_computes_the_ends_and_writes_what_the_full_step_writes(name, dtype):
    """Every packed step of the batch, run both ways on copies of one pool: the pools stay equal bit for bit
    after each step, each segment's last row equals the full step's within the dtype's rounding (the last layer's
    matmuls run over fewer rows, which may block their sums differently), and every other row is zero."""
    model = random_llama(0, name, dtype=str(dtype).removeprefix("torch."))
    batch = Batch(model)
    prepared = batch.runtime.prepare(batch.tokens, batch.table, batch.lengths, batch.cached, mode="eager")
    full_kv, ends_kv = batch.kv, model.new_kv_cache(batch.kv.num_blocks, BS)
    for copy, pool in zip(ends_kv.keys + ends_kv.values, full_kv.keys + full_kv.values):
        copy.copy_(pool)
    steps = 0
    for request_steps in prepared.steps:
        for step in request_steps:
            inputs = [step[spec] for spec in PACKED_INPUTS]
            full = model.forward_packed(*inputs, full_kv)[0]
            ends_out = model.forward_packed(*inputs, ends_kv, ends_only=True)[0]
            for a, b in zip(full_kv.keys + full_kv.values, ends_kv.keys + ends_kv.values):
                assert torch.equal(a, b)
            segments = step[PACKED_SEGMENTS]
            ends = (segments[:, 0] + segments[:, 1] - 1).tolist()
            others = sorted(set(range(full.shape[0])) - set(ends))
            assert not ends_out[others].any()
            tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
            torch.testing.assert_close(ends_out[ends].float(), full[ends].float(), **tol)
            steps += 1
    assert steps > 1  # the batch spans several packed steps, so later steps read earlier steps' writes


def _spy(model, seen: list):
    inner = model.forward_packed

    def forward_packed(*args, ends_only=False):
        seen.append(ends_only)
        return inner(*args, ends_only=ends_only)

    model.forward_packed = forward_packed  # the runtime calls the model's attribute


def test_the_runtime_asks_for_ends_only_where_nothing_reads_other_rows():
    """A sampling call, and a call pooling every row LAST, run every packed step ends-only; a call with prompt
    log-probs never does, nor does a request pooling a row MEAN. Results (tokens, log-probs, pooled vectors)
    equal those of the same model without the capability."""
    model = random_llama(0, "tiny")
    assert supports_segment_ends(model)
    seen: list[bool] = []
    _spy(model, seen)
    batch = Batch(model)
    args = (batch.tokens, batch.table, batch.lengths, batch.cached)
    greedy = SamplingParams.greedy(num_logprobs=3)
    mean = [PoolingType.MEAN if c == 0 else None for c in batch.cached]  # MEAN reads every position
    last = [PoolingType.LAST] * len(batch.cached)

    def run(ends: str, **kwargs):
        """The call's results; ``ends``: which of its packed steps ran ends-only, "all", "none" or "some"."""
        seen.clear()
        results = batch.runtime.prefill(*args, **kwargs)
        assert seen
        assert {"all": all(seen), "none": not any(seen), "some": any(seen) and not all(seen)}[ends], seen
        return results

    ours = [
        run("all", sampling=greedy),
        run("none", sampling=SamplingParams.greedy(prompt_logprobs=1)),
        run("some", pooling=mean),  # requests without a MEAN row need only their ends
        run("all", pooling=last),
    ]

    plain = random_llama(0, "tiny")
    plain.segment_ends = False
    reference = Batch(plain)
    assert reference.runtime._eager_ends is reference.runtime._eager
    rt = reference.runtime
    theirs = [
        rt.prefill(*args, sampling=greedy),
        rt.prefill(*args, sampling=SamplingParams.greedy(prompt_logprobs=1)),
        rt.prefill(*args, pooling=mean),
        rt.prefill(*args, pooling=last),
    ]
    for got, want in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        assert got.token == want.token
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
        torch.testing.assert_close(
            torch.tensor([p for _, p in got.top_logprobs]), torch.tensor([p for _, p in want.top_logprobs])
        )
    for got, want in zip(ours[2] + ours[3], theirs[2] + theirs[3]):
        assert (got.pooled is None) == (want.pooled is None)
        if got.pooled is not None:
            torch.testing.assert_close(got.pooled, want.pooled, rtol=1e-5, atol=1e-5)
