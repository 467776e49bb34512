"""The reference Llama's CPU kernel forms equal the plain torch expressions they stand for."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from prefill_shell.reference.llama_like import projection as projection_module
from prefill_shell.reference.llama_like.packed_attention import (
    ONE_CALL_KEYS,
    SHARED_PREFIX_LENGTH,
    prefix_then_causal,
    segment_attention,
    segment_reads,
)
from prefill_shell.reference.llama_like.projection import PACKED_MAX_ROWS, Projection, prepacks
from prefill_shell.reference.pools.kv_cache import PagedKVCache

GEN = torch.Generator().manual_seed(5)


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(dtype)


@pytest.mark.parametrize("max_rows", [0, PACKED_MAX_ROWS, sys.maxsize])
@pytest.mark.parametrize("rows", [1, 3, 130, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 1100])
def test_a_projection_and_its_fused_forms_equal_f_linear(rows, max_rows):
    """x W^T, silu(x W^T), (x W^T) * other and other + x W^T match F.linear's, prepacked or not, under every
    row limit the probe can choose (none prepacked, short products only, every product)."""
    weight, x, other = _randn(48, 40), _randn(rows, 40), _randn(rows, 48)
    projection = Projection(weight)
    if prepacks(weight):
        projection.max_rows = max_rows
    assert prepacks(weight) == torch.backends.mkldnn.is_available()
    plain = F.linear(x, weight)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(projection(x), plain, **tol)
    torch.testing.assert_close(projection.silu(x), F.silu(plain), **tol)
    torch.testing.assert_close(projection.times(x, other), plain * other, **tol)
    torch.testing.assert_close(projection.plus(x, other), other + plain, **tol)
    torch.testing.assert_close(projection(x.view(1, rows, 40)), plain.view(1, rows, 48), **tol)


def test_a_projection_leaves_its_weight_and_inputs_alone():
    """The plain weight stays the caller's tensor (state_dict shares it); no form writes its inputs."""
    weight, x, other = _randn(16, 8), _randn(4, 8), _randn(4, 16)
    before = (weight.clone(), x.clone(), other.clone())
    projection = Projection(weight)
    assert projection.weight is weight
    for form in (projection.silu, lambda t: projection.times(t, other), lambda t: projection.plus(t, other)):
        form(x)
    assert all(torch.equal(a, b) for a, b in zip((weight, x, other), before))


def test_a_bfloat16_projection_prepacks_only_where_the_cpu_has_bf16_matrix_instructions():
    """bfloat16 is prepacked where AMX or AVX-512 BF16 is present (and oneDNN takes it): its fused forms then
    round once where F.linear's expressions round after each op, so they agree to bf16 rounding; elsewhere
    a bfloat16 projection runs F.linear exactly."""
    weight, x, other = (_randn(*s, dtype=torch.bfloat16) for s in ((48, 40), (130, 40), (130, 48)))
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    expected = bool(native and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    projection = Projection(weight)
    assert prepacks(weight) == expected
    plain = F.linear(x, weight)
    if not expected:
        assert torch.equal(projection(x), plain)
        return
    tol = {"rtol": 2e-2, "atol": 2e-2}  # outputs of O(6): a few bf16 ulps
    torch.testing.assert_close(projection(x), plain, **tol)
    torch.testing.assert_close(projection.silu(x), F.silu(plain), **tol)
    torch.testing.assert_close(projection.times(x, other), plain * other, rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(projection.plus(x, other), other + plain, **tol)


@pytest.mark.parametrize("limit", ["probed", PACKED_MAX_ROWS])
def test_a_product_past_its_row_limit_runs_the_plain_expressions_bit_for_bit(limit):
    """Past the projection's row limit (the probed one, and the short limit a machine whose BLAS wins long
    products gets) every form is the plain expression (``F.linear``, ``mul_``, ``addmm``), bit for bit; at
    the limit a bfloat16 weight the CPU prepacks takes the fused form, whose single rounding differs from the
    plain expression's two somewhere in the output."""
    weight = _randn(48, 40, dtype=torch.bfloat16)
    projection = Projection(weight)
    if limit != "probed" and prepacks(weight):
        projection.max_rows = limit
    for rows in (PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 3 * PACKED_MAX_ROWS):
        x, other = _randn(rows, 40, dtype=torch.bfloat16), _randn(rows, 48, dtype=torch.bfloat16)
        plain = {
            "call": F.linear(x, weight),
            "silu": F.silu(F.linear(x, weight)),
            "times": F.linear(x, weight).mul_(other),
            "plus": torch.addmm(other, x, weight.t()),
        }
        ours = {
            "call": projection(x),
            "silu": projection.silu(x),
            "times": projection.times(x, other),
            "plus": projection.plus(x, other),
        }
        same = {form: torch.equal(ours[form], plain[form]) for form in plain}
        if rows > projection.max_rows or not prepacks(weight):
            assert all(same.values()), (rows, same)
        else:
            assert not same["silu"], "the fused activation rounds once, so some element differs from silu(linear)'s two"


@pytest.mark.parametrize(("start", "length"), [(1, 1), (16, 1), (5, 9), (64, 64), (7, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_then_causal_equals_one_masked_call_over_the_joined_keys(start, length, dtype):
    """Two flash calls merged by log-sum-exp == SDPA over [prefix | own] with key j visible iff j <= start + i."""
    heads, kv_heads, dim = 8, 2, 32
    q = _randn(1, heads, length, dim, dtype=dtype)
    prefix = (_randn(1, kv_heads, start, dim, dtype=dtype), _randn(1, kv_heads, start, dim, dtype=dtype))
    own = (_randn(1, kv_heads, length, dim, dtype=dtype), _randn(1, kv_heads, length, dim, dtype=dtype))
    visible = torch.ones(length, start + length, dtype=torch.bool).tril(diagonal=start)
    keys, values = (torch.cat((p, o), dim=2) for p, o in zip(prefix, own))
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
    got = prefix_then_causal(q, prefix, own)
    assert got.dtype == dtype and got.shape == expected.shape
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_and_long_cached_segments_attend_as_one_masked_call_over_the_joined_keys(dtype):
    """A step of a short cached segment (one masked call), a long one (``prefix_then_causal``, more than
    ``ONE_CALL_KEYS`` keys) and an uncached one: each segment's output equals one SDPA over its row's
    pooled prefix then its own keys, key j visible to query i iff j <= start + i."""
    heads, kv_heads, dim, bs = 4, 2, 16, 16
    short, long_start = (40, 9), ONE_CALL_KEYS - 3  # long: start + length > ONE_CALL_KEYS
    segments_spec = [(short[0], short[1]), (long_start, 6), (0, 11)]  # (start, length)
    kv = PagedKVCache(1, 64, bs, kv_heads, dim, dtype=dtype)
    kv.keys[0].copy_(_randn(*kv.keys[0].shape, dtype=dtype))
    kv.values[0].copy_(_randn(*kv.values[0].shape, dtype=dtype))
    widths = [-(-start // bs) for start, _ in segments_spec]
    table = torch.zeros(len(widths), max(widths), dtype=torch.int32)
    first = 0
    for i, width in enumerate(widths):
        table[i, :width] = torch.arange(first, first + width)
        first += width
    offsets = [sum(n for _, n in segments_spec[:i]) for i in range(len(segments_spec))]
    segments = torch.tensor([[o, n, s] for o, (s, n) in zip(offsets, segments_spec)])
    total = sum(n for _, n in segments_spec)
    q, k, v = (
        _randn(total, heads, dim, dtype=dtype),
        _randn(total, kv_heads, dim, dtype=dtype),
        _randn(total, kv_heads, dim, dtype=dtype),
    )
    reads = segment_reads(segments, table, bs, dtype)
    assert [r.mask is not None for r in reads.segments] == [True, False, False]

    def sdpa(q_, k_, v_, **kw):
        return F.scaled_dot_product_attention(q_, k_, v_, enable_gqa=True, **kw)

    got = segment_attention(kv, 0, (q, k, v), reads, sdpa)
    for i, ((start, length), offset) in enumerate(zip(segments_spec, offsets)):
        span = slice(offset, offset + length)
        old_k, old_v = (x[0, :, :start] for x in kv.gather(0, table[i : i + 1, : widths[i]])) if start else (None, None)
        keys = k[span].transpose(0, 1) if not start else torch.cat((old_k, k[span].transpose(0, 1)), dim=1)
        values = v[span].transpose(0, 1) if not start else torch.cat((old_v, v[span].transpose(0, 1)), dim=1)
        visible = torch.ones(length, start + length, dtype=torch.bool).tril(diagonal=start)
        expected = sdpa(q[span].transpose(0, 1)[None], keys[None], values[None], attn_mask=visible)[0].transpose(0, 1)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(got[span], expected, **tol)


@pytest.mark.parametrize(("setting", "expected"), [("short", PACKED_MAX_ROWS), ("all", sys.maxsize), ("300", 300)])
def test_the_row_limit_setting_overrides_the_probe(monkeypatch, setting, expected):
    """``PREFILL_CPU_PREPACKED_ROWS`` decides the limit of the projections built after it is read."""
    monkeypatch.setenv(projection_module.ROWS_SETTING, setting)
    projection_module.packed_row_limit.cache_clear()
    try:
        weight = _randn(48, 40)
        if not prepacks(weight):
            pytest.skip("this torch has no oneDNN: no weight is prepacked")
        assert Projection(weight).max_rows == expected
    finally:
        projection_module.packed_row_limit.cache_clear()


def test_the_probe_times_both_forms_and_auto_follows_it():
    """The probe's rates are real timings (positive, of the dtype asked), and ``auto``'s limit is the core's
    decision over them."""
    from prefill_core.values.linear_form import prepacked_row_limit
    from prefill_shell.backends.numerics import linear_form_probe

    if not prepacks(_randn(4, 4)):
        pytest.skip("this torch has no oneDNN: nothing to probe")
    probe = linear_form_probe(torch.float32)
    assert probe.dtype == "float32" and probe.plain_gflops > 0 and probe.prepacked_gflops > 0
    expected = prepacked_row_limit(probe)
    assert projection_module.packed_row_limit(torch.float32) == (sys.maxsize if expected is None else expected)


def _per_segment_expected(kv, table, widths, spec, offsets, qkv, sdpa):
    """Each segment's attention on its own: its row's pooled prefix, then its own keys, causally."""
    q, k, v = qkv
    out = {}
    for i, ((start, length), offset) in enumerate(zip(spec, offsets)):
        span = slice(offset, offset + length)
        old_k, old_v = (x[0, :, :start] for x in kv.gather(0, table[i : i + 1, : widths[i]]))
        keys = torch.cat((old_k, k[span].transpose(0, 1)), dim=1)
        values = torch.cat((old_v, v[span].transpose(0, 1)), dim=1)
        visible = torch.ones(length, start + length, dtype=torch.bool).tril(diagonal=start)
        out[i] = sdpa(q[span].transpose(0, 1)[None], keys[None], values[None], attn_mask=visible)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_segments_behind_one_shared_prefix_run_as_one_padded_call_and_each_equals_its_own(dtype):
    """Rows behind the same prefix blocks at the same start (a shared system prompt) form one padded group
    while the padding bound holds; a row behind other blocks, at another start, or too long for the bound
    starts its own read. Every segment's output equals its attention computed alone."""
    heads, kv_heads, dim, bs = 4, 2, 16, 16
    shared_width = 3  # 48 cached tokens in blocks 0..2, shared by rows 0-2 and 4
    spec = [(48, 9), (48, 12), (48, 7), (48, 10), (48, 11), (48, 40), (32, 8)]  # (start, length)
    tables = [[0, 1, 2], [0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5], [3, 4, 5], [0, 1]]
    # rows 0-2: one group (same blocks, same start); row 3: other blocks; row 4 joins row 3;
    # row 5: the same blocks as 3-4, but 40 tokens would pad 3 rows to 120 for 61 real (> 1.5x);
    # row 6: another start.
    kv = PagedKVCache(1, 8, bs, kv_heads, dim, dtype=dtype)
    kv.keys[0].copy_(_randn(*kv.keys[0].shape, dtype=dtype))
    kv.values[0].copy_(_randn(*kv.values[0].shape, dtype=dtype))
    widths = [len(t) for t in tables]
    table = torch.tensor([t + [0] * (shared_width - len(t)) for t in tables], dtype=torch.int32)
    offsets = [sum(n for _, n in spec[:i]) for i in range(len(spec))]
    segments = torch.tensor([[o, n, s] for o, (s, n) in zip(offsets, spec)])
    total = sum(n for _, n in spec)
    qkv = (
        _randn(total, heads, dim, dtype=dtype),
        _randn(total, kv_heads, dim, dtype=dtype),
        _randn(total, kv_heads, dim, dtype=dtype),
    )
    reads = segment_reads(segments, table, bs, dtype)
    assert [(r.offset, r.rows, r.length, r.padded is not None) for r in reads.segments] == [
        (0, 3, 12, True),
        (28, 2, 11, True),
        (49, 1, 40, False),
        (89, 1, 8, False),
    ]
    assert reads.prefix_blocks.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 5, 0, 1]]  # a group gathers its prefix once

    def sdpa(q_, k_, v_, **kw):
        return F.scaled_dot_product_attention(q_, k_, v_, enable_gqa=True, **kw)

    got = segment_attention(kv, 0, qkv, reads, sdpa)
    assert got.shape == (total, heads, dim)
    expected = _per_segment_expected(kv, table, widths, spec, offsets, qkv, sdpa)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for i, (_, length) in enumerate(spec):
        torch.testing.assert_close(got[offsets[i] : offsets[i] + length], expected[i], **tol)


def test_segments_longer_than_the_shared_prefix_limit_keep_one_call_each():
    """Two equal cached segments behind the same blocks, each longer than ``SHARED_PREFIX_LENGTH``: no padding
    at all, yet they stay one read each (past the limit the joint call computed more than it saved)."""
    length = SHARED_PREFIX_LENGTH + 1
    segments = torch.tensor([[0, length, 32], [length, length, 32]])
    table = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    reads = segment_reads(segments, table, 16, torch.float32)
    assert [(r.rows, r.padded is None) for r in reads.segments] == [(1, True), (1, True)]
    short = torch.tensor([[0, SHARED_PREFIX_LENGTH, 32], [SHARED_PREFIX_LENGTH, SHARED_PREFIX_LENGTH, 32]])
    assert [r.rows for r in segment_reads(short, table, 16, torch.float32).segments] == [2]
