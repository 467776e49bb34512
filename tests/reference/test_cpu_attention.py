"""The CPU attention kernel of packed steps (prefill_shell/reference/cpu_kernels) against float64 attention
written out here: every segment, cached or not, with its prefix read from the paged pool."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_shell.reference.cpu_kernels import library
from prefill_shell.reference.cpu_kernels.flash import flash_step
from prefill_shell.reference.pools.kv_cache import PagedKVCache

BS = 16
NEEDS_F32 = pytest.mark.skipif(torch.float32 not in library.kernel_dtypes(), reason="no AVX-512 or no C compiler here")
DTYPES = [
    pytest.param(torch.float32, marks=NEEDS_F32),
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(torch.bfloat16 not in library.kernel_dtypes(), reason="no AVX512-BF16 here"),
    ),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
"""bfloat16: the output's own rounding (one unit in the last place near 2 is 1.6e-2) and probabilities rounded
to bfloat16 before they meet the values, as torch's flash kernel rounds them."""


class Step:
    """A packed step's inputs: segments end to end, q/k/v as the views a fused QKV projection gives."""

    def __init__(self, segments, heads, kv_heads, dim, dtype, seed=0, blocks=64):
        gen = torch.Generator().manual_seed(seed)
        self.segments, self.heads, self.kv_heads, self.dim, self.dtype = segments, heads, kv_heads, dim, dtype
        self.total = sum(length for length, _ in segments)
        self.offsets = [sum(n for n, _ in segments[:i]) for i in range(len(segments))]
        # Q, K and V side by side per token, as QKV projection writes them: K and V have different strides.
        width = (heads + 2 * kv_heads) * dim
        qkv = torch.randn(self.total, width, generator=gen).to(dtype)
        self.q = qkv[:, : heads * dim].unflatten(-1, (heads, dim))
        self.k = qkv[:, heads * dim : (heads + kv_heads) * dim].unflatten(-1, (kv_heads, dim))
        self.v = qkv[:, (heads + kv_heads) * dim :].unflatten(-1, (kv_heads, dim))
        self.kv = PagedKVCache(1, blocks, BS, kv_heads, dim, dtype=dtype)
        # Every slot no query may read holds NaN: unused blocks, the sink, and cached blocks past `start`.
        self.kv.keys[0].fill_(math.nan)
        self.kv.values[0].fill_(math.nan)
        widest = max(math.ceil(start / BS) for _, start in segments) + 1
        self.table = torch.full((len(segments), widest), -1, dtype=torch.int32)
        order = torch.randperm(blocks - 1, generator=gen)  # not the sink (the last block)
        used = 0
        for row, (_, start) in enumerate(segments):
            n = math.ceil(start / BS)
            ids = order[used : used + n]
            used += n
            self.table[row, :n] = ids
            for position in range(start):
                block, slot = ids[position // BS], position % BS
                self.kv.keys[0][block, :, slot] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
                self.kv.values[0][block, :, slot] = torch.randn(kv_heads, dim, generator=gen).to(dtype)

    def segment_table(self) -> torch.Tensor:
        return torch.tensor([(o, n, s) for o, (n, s) in zip(self.offsets, self.segments)])

    def kernel(self) -> torch.Tensor:
        step = flash_step(
            self.segment_table(), self.table, self.kv, self.heads, self.kv_heads, self.dim, self.dtype, self.total
        )
        assert step is not None
        return step(self.kv, 0, self.q, self.k, self.v)

    def expected(self) -> torch.Tensor:
        """float64 softmax attention, one query head at a time: prefix keys then the segment's own, causal."""
        groups = self.heads // self.kv_heads
        out = torch.empty(self.total, self.heads, self.dim, dtype=torch.float64)
        for row, ((length, start), offset) in enumerate(zip(self.segments, self.offsets)):
            ids = self.table[row, : math.ceil(start / BS)].long()
            prefix = [p[ids].transpose(0, 1).flatten(1, 2)[:, :start] for p in (self.kv.keys[0], self.kv.values[0])]
            own = slice(offset, offset + length)
            keys = torch.cat((prefix[0], self.k[own].transpose(0, 1)), 1).double()  # [Hkv, start + length, D]
            values = torch.cat((prefix[1], self.v[own].transpose(0, 1)), 1).double()
            visible = torch.ones(length, start + length, dtype=torch.bool).tril(start)
            for h in range(self.heads):
                scores = self.q[own, h].double() @ keys[h // groups].T / math.sqrt(self.dim)
                weights = scores.masked_fill(~visible, -math.inf).softmax(-1)
                out[own, h] = weights @ values[h // groups]
        return out


LAYOUTS = {
    "uncached": [(5, 0), (70, 0), (128, 0), (1, 0)],
    "cached": [(130, 37), (64, 128), (1, 300), (20, 16)],
    "long": [(300, 0), (200, 100)],
    "chat": [(17, 80)] * 6,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 64), (4, 2, 128), (9, 3, 64), (4, 4, 64)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_equals_attention_over_prefix_and_own_keys(layout, heads, kv_heads, dim, dtype):
    """Each query sees its row's cached positions (read from the pool's blocks in place) and its own keys up to
    itself; NaN everywhere else in the pool (unused blocks, slots at or past a row's start) reaches nothing."""
    step = Step(LAYOUTS[layout], heads, kv_heads, dim, dtype)
    got = step.kernel()
    assert got.dtype == dtype and got.shape == step.q.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), step.expected(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@NEEDS_F32
@settings(max_examples=25, deadline=None)
@given(
    segments=st.lists(st.tuples(st.integers(1, 150), st.integers(0, 200)), min_size=1, max_size=5),
    heads=st.sampled_from([(4, 2), (9, 3), (6, 1), (5, 5)]),
    seed=st.integers(0, 2**16),
)
def test_kernel_on_any_segment_layout(segments, heads, seed):
    """Any lengths and starts (a start inside a block included), at float32; head groups whose blocks of query
    positions straddle key blocks (3 and 6 query heads a KV head), so a tile's last visible key falls anywhere
    in the block it reads."""
    blocks = sum(math.ceil(s / BS) for _, s in segments) + 2
    step = Step(segments, *heads, 64, torch.float32, seed, blocks=blocks)
    torch.testing.assert_close(step.kernel().double(), step.expected(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_split_work_without_changing_a_bit(dtype):
    """Each work item runs whole on one thread, so the thread count changes no output bit."""
    step = Step(LAYOUTS["cached"] + LAYOUTS["long"], 8, 4, 64, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = step.kernel()
        torch.set_num_threads(3)
        shared = step.kernel()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)


@NEEDS_F32
@pytest.mark.parametrize(
    "segments, kv_heads, threads",
    [([(3, 0)], 1, 1), ([(3, 0)], 2, 1), ([(3, 70)], 1, 1), ([(100, 0)], 1, 0), ([(3, 400)], 4, 0)],
)
def test_work_is_shared_out_from_two_items_and_enough_flops(segments, kv_heads, threads):
    """A step whose packing and attention are one item each, or a few items of less than SHARED_FLOPS, runs on
    the calling thread alone; more work in two items or more is shared out (0: torch's threads)."""
    step = Step(segments, 2 * kv_heads, kv_heads, 64, torch.float32, blocks=32)
    total = sum(length for length, _ in segments)
    flash = flash_step(step.segment_table(), step.table, step.kv, 2 * kv_heads, kv_heads, 64, torch.float32, total)
    assert flash.threads == threads
    torch.testing.assert_close(step.kernel().double(), step.expected(), rtol=1e-5, atol=1e-5)


@NEEDS_F32
def test_where_the_kernel_does_not_apply_the_step_is_none():
    """A head size it lacks, a dtype it lacks, a pool in another dtype, a prefix position without a block, and
    segments that do not tile the step all leave attention to torch (None)."""
    step = Step([(20, 16), (10, 0)], 4, 2, 64, torch.float32)
    table = step.segment_table()
    assert flash_step(table, step.table, step.kv, 4, 2, 64, torch.float32, 30) is not None
    assert flash_step(table, step.table, step.kv, 4, 2, 80, torch.float32, 30) is None
    assert flash_step(table, step.table, step.kv, 4, 2, 64, torch.float16, 30) is None
    assert flash_step(table, step.table, step.kv, 4, 2, 64, torch.float32, 31) is None
    other = PagedKVCache(1, 8, BS, 2, 64, dtype=torch.float64)
    assert flash_step(table, step.table, other, 4, 2, 64, torch.float32, 30) is None
    holes = step.table.clone()
    holes[0, 0] = -1
    assert flash_step(table, holes, step.kv, 4, 2, 64, torch.float32, 30) is None
    gap = torch.tensor([(0, 20, 16), (21, 9, 0)])
    assert flash_step(gap, step.table, step.kv, 4, 2, 64, torch.float32, 30) is None
    assert flash_step(torch.zeros(0, 3, dtype=torch.int64), step.table, step.kv, 4, 2, 64, torch.float32, 0) is None


def test_the_setting_turns_the_kernel_off(monkeypatch):
    """PREFILL_CPU_KERNELS=torch: no kernel dtypes, so packed steps keep torch's SDPA and bfloat16 norms torch's ops."""
    monkeypatch.setenv(library.SETTING, "torch")
    library.kernel_dtypes.cache_clear()
    try:
        assert library.kernel_dtypes() == frozenset()
    finally:
        monkeypatch.undo()
        library.kernel_dtypes.cache_clear()


@NEEDS_F32
def test_a_call_that_does_not_match_its_step_is_refused():
    """The kernel reads raw memory, so tensors of another shape or dtype, or a smaller pool, raise first."""
    step = Step([(20, 40), (10, 0)], 4, 2, 64, torch.float32)
    flash = flash_step(step.segment_table(), step.table, step.kv, 4, 2, 64, torch.float32, 30)
    with pytest.raises(ValueError, match="q is torch.float32 \\(29, 4, 64\\)"):
        flash(step.kv, 0, step.q[:29], step.k, step.v)
    with pytest.raises(ValueError, match="v is torch.bfloat16"):
        flash(step.kv, 0, step.q, step.k, step.v.to(torch.bfloat16))
    small = PagedKVCache(1, 2, BS, 2, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="is not the step's"):
        flash(small, 0, step.q, step.k, step.v)


@NEEDS_F32
def test_the_kernels_share_torchs_openmp_runtime():
    """The library's OpenMP calls bind to the libgomp torch loaded: its threads are torch's, not a second pool
    competing with torch's spinning workers for the cores. (Other packages may load runtimes of their own.)"""
    import ctypes
    from pathlib import Path

    kernels = library.kernel_library()
    torch_dir = Path(torch.__file__).parent
    with open("/proc/self/maps") as maps:
        torch_gomp = {
            line.split()[-1] for line in maps if "libgomp" in line and line.split()[-1].startswith(str(torch_dir))
        }
    if not torch_gomp:
        pytest.skip("this torch carries no libgomp of its own")
    ours = ctypes.cast(kernels.omp_get_max_threads, ctypes.c_void_p).value
    theirs = ctypes.cast(ctypes.CDLL(torch_gomp.pop()).omp_get_max_threads, ctypes.c_void_p).value
    assert ours == theirs


def test_an_unwritable_kernel_cache_leaves_torchs_ops(monkeypatch, tmp_path):
    """Where the library cannot be built (its cache directory is a file here), there is no library, a warning
    says why, and no dtype runs the kernels: the model keeps torch's ops rather than failing."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("PREFILL_KERNEL_CACHE", str(blocker / "kernels"))
    library.kernel_library.cache_clear()
    library.kernel_dtypes.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="the model keeps torch's ops"):
            assert library.kernel_library() is None
        assert library.kernel_dtypes() == frozenset()
    finally:
        monkeypatch.undo()
        library.kernel_library.cache_clear()
        library.kernel_dtypes.cache_clear()
