"""Values a step must not read never reach an output or a written block (DESIGN invariant 16).

A serving engine recycles pool blocks with stale contents, and fp16 overflow
leaves inf behind. These tests fill every block a step must not read (filler
block 0, other rows' blocks, the row's own not-yet-written blocks, the sink)
with NaN, inf or huge finite values and compare against a run on a clean
pool: through the runtime's public API and through ``forward_hidden``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefill_core import PrefillPolicy
from tests.helpers import CHUNK_256_POLICY, TOL, build_runtime, make_tokens, max_abs_diff, page_table, row_kv

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many small steps: see the fixture

BS = 32


def _poison(kv, blocks, value: float) -> None:
    """Writes ``value`` into every K and V entry of ``blocks`` in every layer."""
    ids = torch.tensor(list(blocks))
    for pool in kv.keys + kv.values:
        pool[ids] = value


def _written_layers_finite(kv, blocks) -> bool:
    ids = torch.tensor(list(blocks))
    return all(bool(pool[ids].isfinite().all()) for pool in kv.keys + kv.values)


# ---------------------------------------------------------------- issue 15 item 9 reproducers


def test_nan_in_unowned_filler_block_leaves_cached_row_logits_finite(tiny_model, oracle):
    """A 33-token row cached 32 at block 32 gets the oracle's logits although filler block 0 holds NaN."""
    rt = build_runtime(tiny_model, num_blocks=8, block_size=BS)
    tokens = make_tokens(33, seed=90)
    table = page_table([[3, 5]])
    rt.prefill(tokens[None, :32], table[:, :1], [32])  # the cached prefix, computed for real
    _poison(rt.config.kv, [0], float("nan"))
    (result,) = rt.prefill(tokens[None], table, [33], [32])
    assert max_abs_diff(result.logits, oracle.logits(tokens)) <= TOL
    assert _written_layers_finite(rt.config.kv, [3, 5])


def test_nan_in_own_later_block_leaves_2049_token_row_and_its_kv_finite(tiny_model, oracle):
    """An uncached 2049-token row whose last block (written by chunk 2) starts as NaN gets oracle logits and KV."""
    rt = build_runtime(tiny_model, num_blocks=72, block_size=BS, policy=PrefillPolicy(max_chunk_length=2048))
    tokens = make_tokens(2049, seed=91)
    blocks = list(range(1, 66))
    _poison(rt.config.kv, [blocks[-1]], float("nan"))
    (result,) = rt.prefill(tokens[None], page_table([blocks]), [2049])
    assert max_abs_diff(result.logits, oracle.logits(tokens)) <= TOL
    keys, values = oracle.kv(tokens)
    for layer in range(tiny_model.spec.num_layers):
        got_k, got_v = row_kv(rt.config.kv, layer, blocks, 2049)
        assert max_abs_diff(got_k, keys[layer]) <= TOL, f"layer {layer} keys"
        assert max_abs_diff(got_v, values[layer]) <= TOL, f"layer {layer} values"


# ---------------------------------------------------------------- garbage and pools

GARBAGE = (float("nan"), float("inf"), float("-inf"), 3.0e38, -3.0e38, 65504.0)
"""What recycled or overflowed blocks hold: NaN, both infinities, huge finite values (fp32 and fp16 extremes)."""


@st.composite
def garbage_values(draw) -> tuple[tuple[float, ...], int]:
    """A non-empty subset of ``GARBAGE`` that always holds a non-finite value, and a seed for mixing it."""
    values = draw(st.lists(st.sampled_from(GARBAGE), min_size=1, max_size=4, unique=True))
    if all(abs(v) < float("inf") for v in values):
        values.append(float("nan"))
    return tuple(values), draw(st.integers(0, 2**31 - 1))


def _garbage_fill(kv, blocks, garbage) -> None:
    """Writes a seeded elementwise mix of ``garbage`` into ``blocks`` (sink allowed) of every layer's K and V."""
    values, seed = garbage
    ids = torch.tensor(sorted(blocks))
    table = torch.tensor(values, dtype=kv.dtype)
    gen = torch.Generator().manual_seed(seed)
    for pool in kv.keys + kv.values:
        pick = torch.randint(len(values), (len(ids), *pool.shape[1:]), generator=gen)
        pool[ids] = table[pick]


def _noise_fill(kv, blocks, seed: int) -> None:
    """Seeded finite noise in ``blocks``: cached contents, identical on the clean and the garbage side."""
    if not blocks:
        return
    ids = torch.tensor(sorted(blocks))
    gen = torch.Generator().manual_seed(seed)
    for pool in kv.keys + kv.values:
        pool[ids] = torch.randn((len(ids), *pool.shape[1:]), generator=gen, dtype=pool.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _pools_agree(clean, dirty, blocks) -> bool:
    """Whether ``blocks`` hold the same bytes in both pools, over every layer's K and V."""
    return all(_same_bits(clean.block_bytes(b), dirty.block_bytes(b)) for b in blocks)


# ---------------------------------------------------------------- the model, step by step

MODEL_BS = 16
MODEL_BLOCKS = 24
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def chunked_rows(draw) -> dict:
    """A chunked, cached or fully cached row, scheduled the way the planner does it."""
    num_blocks = draw(st.integers(1, 12))
    last = draw(st.integers(1, MODEL_BS))  # tokens in the row's last block
    length = (num_blocks - 1) * MODEL_BS + last
    cached = MODEL_BS * draw(st.integers(0, num_blocks if last == MODEL_BS else num_blocks - 1))
    chunk = draw(st.sampled_from((32, 64, 128)))
    blocks = draw(st.permutations(range(1, MODEL_BLOCKS)))[:num_blocks]
    # The table covers every chunk: start + chunk <= width * bs, as the planner's widths guarantee.
    width = num_blocks - 1 + chunk // MODEL_BS + draw(st.integers(0, 3))
    tokens = torch.randint(1, 256, (length,), generator=torch.Generator().manual_seed(draw(st.integers(0, 999))))
    return {"length": length, "cached": cached, "chunk": chunk, "blocks": blocks, "width": width, "tokens": tokens}


def _run_chunks(model, kv, row: dict, fixed_shape: bool) -> list[torch.Tensor]:
    """Every step's hidden output for one row; a fully cached row re-runs its final block, writing nothing."""
    length, cached, chunk, blocks = row["length"], row["cached"], row["chunk"], row["blocks"]
    read = torch.tensor([blocks + [0] * (row["width"] - len(blocks))], dtype=torch.int32)
    first = cached if cached < length else length - MODEL_BS
    outputs = []
    for start in range(first, length, chunk):
        piece = torch.zeros(1, chunk, dtype=torch.int64)
        real = row["tokens"][start : start + chunk]
        piece[0, : len(real)] = real
        columns = range(start, start + chunk, MODEL_BS)
        fill = [[blocks[p // MODEL_BS] if cached <= p < length else -1 for p in columns]]
        fill = torch.tensor(fill, dtype=torch.int32)
        outputs.append(model.forward_hidden(piece, torch.tensor([start]), fill, read, kv, fixed_shape=fixed_shape))
    return outputs


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager", "fixed_shape"])
@PROPERTY
@given(row=chunked_rows(), garbage=garbage_values())
def test_chunk_steps_ignore_garbage_in_every_block_they_must_not_read(tiny_model, fixed_shape, row, garbage):
    """Garbage in filler, the row's unwritten blocks and the sink changes no step's hidden or written blocks."""
    cached_blocks = row["blocks"][: row["cached"] // MODEL_BS]
    clean, dirty = (tiny_model.new_kv_cache(MODEL_BLOCKS, MODEL_BS) for _ in range(2))
    for kv in (clean, dirty):
        _noise_fill(kv, cached_blocks, seed=5)
    unreadable = set(range(MODEL_BLOCKS + 1)) - set(cached_blocks)  # the sink included
    _garbage_fill(dirty, unreadable, garbage)
    before = dirty.snapshot()
    expected = _run_chunks(tiny_model, clean, row, fixed_shape)
    actual = _run_chunks(tiny_model, dirty, row, fixed_shape)
    assert all(e.isfinite().all() and _same_bits(a, e) for a, e in zip(actual, expected, strict=True))
    assert _pools_agree(clean, dirty, row["blocks"])
    foreign = sorted(set(range(MODEL_BLOCKS)) - set(row["blocks"]))
    assert _same_bits(dirty.snapshot()[:, :, foreign], before[:, :, foreign])


@st.composite
def regular_waves(draw) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(tokens [B, S], fill table, written blocks) of a regular wave whose last rows may be padding rows."""
    seq = draw(st.sampled_from((32, 64, 128)))
    lengths = draw(st.lists(st.integers(1, seq), min_size=1, max_size=3))
    padding_rows = draw(st.integers(0, 2))
    free = draw(st.permutations(range(MODEL_BLOCKS)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 999)))
    tokens = torch.zeros(len(lengths) + padding_rows, seq, dtype=torch.int64)
    fill = torch.full((len(lengths) + padding_rows, seq // MODEL_BS), -1, dtype=torch.int32)
    written = []
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(1, 256, (n,), generator=gen)
        need = -(-n // MODEL_BS)
        fill[i, :need] = torch.tensor(free[len(written) : len(written) + need])
        written += free[len(written) : len(written) + need]
    return tokens, fill, written


@PROPERTY
@given(wave=regular_waves(), garbage=garbage_values())
def test_regular_wave_with_padding_rows_ignores_garbage_anywhere_in_the_pool(tiny_model, wave, garbage):
    """A regular wave (padding rows write to the sink) gives bit-identical hidden and blocks over a pool of garbage."""
    tokens, fill, written = wave
    clean, dirty = (tiny_model.new_kv_cache(MODEL_BLOCKS, MODEL_BS) for _ in range(2))
    _garbage_fill(dirty, range(MODEL_BLOCKS + 1), garbage)
    start = torch.zeros(tokens.shape[0], dtype=torch.int64)
    expected = tiny_model.forward_hidden(tokens, start, fill, None, clean)
    actual = tiny_model.forward_hidden(tokens, start, fill, None, dirty)
    assert expected.isfinite().all() and _same_bits(actual, expected)
    assert _pools_agree(clean, dirty, written)


# ---------------------------------------------------------------- the runtime, through its public API

RUNTIME_BLOCKS = 128


@st.composite
def prefill_calls(draw) -> dict:
    """One to three rows: regular, chunked (256-token chunks), prefix-cached or fully cached, on disjoint blocks."""
    rows = []
    free = draw(st.permutations(range(RUNTIME_BLOCKS)))
    for _ in range(draw(st.integers(1, 3))):
        num_blocks = draw(st.integers(1, 40))
        last = draw(st.integers(1, MODEL_BS))
        cached_blocks = draw(st.integers(0, num_blocks if last == MODEL_BS else num_blocks - 1))
        rows.append(((num_blocks - 1) * MODEL_BS + last, cached_blocks, free[:num_blocks]))
        free = free[num_blocks:]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 999)))
    lengths = [n for n, _, _ in rows]
    tokens = torch.zeros(len(rows), max(lengths), dtype=torch.int64)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(1, 256, (n,), generator=gen)
    table = torch.full((len(rows), max(len(b) for _, _, b in rows)), -1, dtype=torch.int32)
    for i, (_, _, blocks) in enumerate(rows):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return {
        "tokens": tokens,
        "page_table": table,
        "prompt_lengths": lengths,
        "cached_lengths": [c * MODEL_BS for _, c, _ in rows],
        "cached_blocks": [b for _, c, blocks in rows for b in blocks[:c]],
        "owned": [b for _, _, blocks in rows for b in blocks],
    }


@PROPERTY
@given(call=prefill_calls(), garbage=garbage_values())
def test_runtime_results_ignore_garbage_in_every_block_a_call_must_not_read(tiny_model, call, garbage):
    """Through ``PrefillRuntime.prefill``, garbage outside cached prefixes changes no logits or written blocks."""
    cached_blocks, owned = call.pop("cached_blocks"), call.pop("owned")
    clean, dirty = (
        build_runtime(tiny_model, num_blocks=RUNTIME_BLOCKS, block_size=MODEL_BS, policy=CHUNK_256_POLICY)
        for _ in range(2)
    )
    for rt in (clean, dirty):
        _noise_fill(rt.config.kv, cached_blocks, seed=6)
    _garbage_fill(dirty.config.kv, set(range(RUNTIME_BLOCKS + 1)) - set(cached_blocks), garbage)
    before = dirty.config.kv.snapshot()
    expected, actual = clean.prefill(**call), dirty.prefill(**call)
    for e, a in zip(expected, actual, strict=True):
        assert e.row == a.row and e.logits.isfinite().all() and _same_bits(a.logits, e.logits), f"row {e.row}"
    assert _pools_agree(clean.config.kv, dirty.config.kv, owned)
    foreign = sorted(set(range(RUNTIME_BLOCKS)) - set(owned))
    assert _same_bits(dirty.config.kv.snapshot()[:, :, foreign], before[:, :, foreign])
