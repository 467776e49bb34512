"""The reference paged Llama against transformers' LlamaForCausalLM on the same weights.

Page tables are built by hand here: the tests pin the model protocol's
semantics, not the planner's choices.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from prefill_shell.device.model import ModelSpec, PrefillModel
from prefill_shell.reference import (
    PagedKVCache,
    PagedLlama,
    load_hf_folder,
    random_llama,
    save_hf_folder,
)
from prefill_shell.reference.llama_like.config import LlamaSpec
from prefill_shell.reference.llama_like.llama import rope_inv_freq

transformers = pytest.importorskip("transformers")

BS = 32  # KV block size used throughout
TOL = 1e-4
NUM_BLOCKS = 24


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_llama() -> PagedLlama:
    """The seeded tiny preset, shared by every test in this module."""
    return random_llama(0, "tiny")


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_llama, tmp_path_factory):
    """``tiny_llama`` saved as a Hugging Face folder."""
    return save_hf_folder(tiny_llama, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def hf_tiny_llama(tiny_llama_dir):
    """The oracle: transformers' Llama loaded from ``tiny_llama_dir`` in float32."""
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return model.eval()


# ---------------------------------------------------------------- helpers


def _tokens(length: int, seed: int, vocab: int = 256) -> torch.Tensor:
    # Never token 0, so real tokens are distinguishable from zero padding.
    return torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def _oracle(hf, tokens: torch.Tensor):
    """HF logits of the last token and its KV cache for one unpadded row."""
    with torch.no_grad():
        out = hf(tokens[None], use_cache=True)
    # transformers 5.x renamed the output field `past_key_values` to `cache`.
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    return out.logits[0, -1], cache


def _table(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int32)


def _pool(model: PagedLlama, seed: int | None = None) -> PagedKVCache:
    """A pool, optionally filled with random values so stray writes are visible."""
    kv = model.new_kv_cache(NUM_BLOCKS, BS)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for pool in kv.keys + kv.values:
            pool.copy_(torch.randn(pool.shape, generator=gen))
    return kv


def _regular_wave(model, kv, rows, seq: int, width: int, pad_rows: int = 0) -> torch.Tensor:
    """Runs rows [(tokens, blocks)] plus zero padding rows as one regular wave."""
    tokens = torch.zeros(len(rows) + pad_rows, seq, dtype=torch.int64)
    for i, (toks, _) in enumerate(rows):
        tokens[i, : len(toks)] = toks
    fill = _table([blocks for _, blocks in rows] + [[]] * pad_rows, width)
    start = torch.zeros(tokens.shape[0], dtype=torch.int64)
    return model.forward_hidden(tokens, start, fill, None, kv)


def _chunked_row(model, kv, tokens, blocks, chunk: int, first: int, read_width: int, fixed_shape=None) -> torch.Tensor:
    """Runs positions [first, len) of one row chunk by chunk; returns the last token's hidden."""
    read = torch.tensor([blocks + [0] * (read_width - len(blocks))], dtype=torch.int32)
    for start in range(first, len(tokens), chunk):
        piece = torch.zeros(1, chunk, dtype=torch.int64)
        real = tokens[start : start + chunk]
        piece[0, : len(real)] = real
        fill = _table([blocks[start // BS : (start + chunk) // BS]], chunk // BS)
        hidden = model.forward_hidden(piece, torch.tensor([start]), fill, read, kv, fixed_shape=fixed_shape)
    return hidden[0, len(tokens) - 1 - start]


def _row_kv(kv: PagedKVCache, layer: int, blocks: list[int], length: int):
    """Pool contents of one row as HF lays them out: ([H_kv, length, D], [H_kv, length, D])."""
    ids = torch.tensor(blocks)

    def unpage(pool):  # [nb, H_kv, bs, D] -> [H_kv, nb*bs, D]
        part = pool[ids]
        return part.transpose(0, 1).reshape(part.shape[1], -1, part.shape[3])[:, :length]

    return unpage(kv.keys[layer]), unpage(kv.values[layer])


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (actual - expected).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3g} > {TOL}"


# Three real rows of different lengths; blocks are scattered to exercise indirection.
WAVE_ROWS = [(40, [3, 7], 11), (128, [1, 10, 12, 5], 12), (77, [2, 9, 15], 13)]


def _wave_rows():
    return [(_tokens(n, seed), blocks) for n, blocks, seed in WAVE_ROWS]


# 300 tokens in 10 blocks; never block 0, which the chunked tables use as filler.
LONG_BLOCKS = [4, 17, 8, 20, 6, 13, 22, 11, 19, 14]


# ---------------------------------------------------------------- protocol and config


def test_paged_llama_satisfies_model_protocol_with_preset_spec(tiny_llama):
    """The reference model is a PrefillModel whose spec reports the tiny preset's geometry."""
    assert isinstance(tiny_llama, PrefillModel)
    assert tiny_llama.spec == ModelSpec(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=4096,
    )


def test_tiny_preset_rope_exercises_every_llama3_band(tiny_llama):
    """The tiny preset's frequencies include unscaled, fully scaled and blended bands."""
    cfg = tiny_llama.config
    plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    scaled = rope_inv_freq(cfg)
    kept = torch.isclose(scaled, plain)
    divided = torch.isclose(scaled, plain / cfg.rope_scaling.factor)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_config_reads_rope_parameters_spelling_like_legacy_spelling(tiny_llama):
    """A config.json using transformers 5's rope_parameters parses to the same spec."""
    legacy = tiny_llama.config.to_hf_dict()
    modern = dict(legacy)
    modern["rope_parameters"] = {**modern.pop("rope_scaling"), "rope_theta": modern.pop("rope_theta")}
    assert LlamaSpec.from_hf_dict(modern) == LlamaSpec.from_hf_dict(legacy) == tiny_llama.config


# ---------------------------------------------------------------- logits vs HF


def test_regular_single_padded_row_matches_hf_last_token_logits(tiny_llama, hf_tiny_llama):
    """A 100-token row padded to 128 gives HF's last-token logits on the regular path."""
    toks = _tokens(100, seed=1)
    hidden = _regular_wave(tiny_llama, _pool(tiny_llama), [(toks, [0, 1, 2, 3])], seq=128, width=4)
    expected, _ = _oracle(hf_tiny_llama, toks)
    _assert_close(tiny_llama.lm_head(hidden[:, 99])[0], expected)


def test_regular_wave_of_mixed_lengths_with_padding_row_matches_hf(tiny_llama, hf_tiny_llama):
    """Each real row of a padded 4-row wave gets HF's last-token logits for that row alone."""
    rows = _wave_rows()
    hidden = _regular_wave(tiny_llama, _pool(tiny_llama), rows, seq=128, width=8, pad_rows=1)
    last = torch.stack([hidden[i, len(toks) - 1] for i, (toks, _) in enumerate(rows)])
    logits = tiny_llama.lm_head(last)
    for i, (toks, _) in enumerate(rows):
        expected, _ = _oracle(hf_tiny_llama, toks)
        _assert_close(logits[i], expected)


READS = pytest.mark.parametrize("fixed_shape", [False, True], ids=["eager_reads", "fixed_shape_reads"])
"""Both ways a chunked step reads the pool: the eager prefix-sized gather and the capture-safe full-width one."""


@READS
def test_chunked_prefill_matches_unchunked_hf(tiny_llama, hf_tiny_llama, fixed_shape):
    """A 300-token row run in 128-token chunks gives the unchunked HF last-token logits."""
    toks = _tokens(300, seed=2)
    hidden = _chunked_row(
        tiny_llama, _pool(tiny_llama), toks, LONG_BLOCKS, chunk=128, first=0, read_width=12, fixed_shape=fixed_shape
    )
    expected, _ = _oracle(hf_tiny_llama, toks)
    _assert_close(tiny_llama.lm_head(hidden[None])[0], expected)


@READS
def test_prefix_cached_row_runs_only_its_tail_and_matches_hf(tiny_llama, hf_tiny_llama, fixed_shape):
    """After a 128-token prefix is cached, chunking only the tail from 128 gives HF's logits."""
    toks, blocks = _tokens(230, seed=3), LONG_BLOCKS[:8]
    kv = _pool(tiny_llama)
    _regular_wave(tiny_llama, kv, [(toks[:128], blocks[:4])], seq=128, width=4)
    hidden = _chunked_row(tiny_llama, kv, toks, blocks, chunk=128, first=128, read_width=8, fixed_shape=fixed_shape)
    expected, _ = _oracle(hf_tiny_llama, toks)
    _assert_close(tiny_llama.lm_head(hidden[None])[0], expected)


@READS
def test_fully_cached_final_block_rerun_reads_cache_and_writes_nothing(tiny_llama, hf_tiny_llama, fixed_shape):
    """Re-running a cached row's last block read-only yields HF's logits and leaves the pool bit-identical."""
    toks, blocks = _tokens(128, seed=4), [5, 9, 2, 14]
    kv = _pool(tiny_llama)
    _regular_wave(tiny_llama, kv, [(toks, blocks)], seq=128, width=4)
    before = kv.snapshot().view(torch.uint8)
    read = torch.tensor([blocks], dtype=torch.int32)
    start, fill = torch.tensor([96]), _table([[]], 1)
    hidden = tiny_llama.forward_hidden(toks[None, 96:], start, fill, read, kv, fixed_shape=fixed_shape)
    assert torch.equal(kv.snapshot().view(torch.uint8), before)
    expected, _ = _oracle(hf_tiny_llama, toks)
    _assert_close(tiny_llama.lm_head(hidden[:, -1])[0], expected)


def test_tied_embeddings_checkpoint_matches_hf(tmp_path):
    """A tied-embedding model saves without lm_head and still matches HF's logits."""
    model = random_llama(5, "tiny", tie_word_embeddings=True)
    folder = save_hf_folder(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    toks = _tokens(64, seed=6)
    hidden = _regular_wave(model, _pool(model), [(toks, [0, 1])], seq=64, width=2)
    expected, _ = _oracle(hf, toks)
    _assert_close(model.lm_head(hidden[:, -1])[0], expected)


# ---------------------------------------------------------------- KV pool contents


def _kv_after_wave(model):
    kv = _pool(model, seed=20)
    rows = _wave_rows()
    _regular_wave(model, kv, rows, seq=128, width=8, pad_rows=1)
    return kv, rows


def _kv_after_chunks(model):
    kv = _pool(model, seed=21)
    toks = _tokens(300, seed=2)
    _chunked_row(model, kv, toks, LONG_BLOCKS, chunk=128, first=0, read_width=12)
    return kv, [(toks, LONG_BLOCKS)]


def _kv_after_fixed_shape_chunks(model):
    kv = _pool(model, seed=21)
    toks = _tokens(300, seed=2)
    _chunked_row(model, kv, toks, LONG_BLOCKS, chunk=128, first=0, read_width=12, fixed_shape=True)
    return kv, [(toks, LONG_BLOCKS)]


KV_SCENARIOS = pytest.mark.parametrize(
    "scenario",
    [_kv_after_wave, _kv_after_chunks, _kv_after_fixed_shape_chunks],
    ids=["regular_wave", "chunked", "chunked_fixed_shape"],
)


@KV_SCENARIOS
def test_pool_holds_hf_keys_and_values_at_every_written_position(tiny_llama, hf_tiny_llama, scenario):
    """Every real position a row wrote holds HF's cached (post-RoPE) key and value for it."""
    kv, rows = scenario(tiny_llama)
    for toks, blocks in rows:
        _, cache = _oracle(hf_tiny_llama, toks)
        for layer in range(tiny_llama.spec.num_layers):
            keys, values = _row_kv(kv, layer, blocks, len(toks))
            _assert_close(keys, cache.layers[layer].keys[0])
            _assert_close(values, cache.layers[layer].values[0])


@KV_SCENARIOS
def test_padding_rows_and_negative_entries_write_nothing(tiny_llama, scenario):
    """Blocks no row owns keep their random contents bit for bit; owned blocks are rewritten."""
    untouched = _pool(tiny_llama, seed=20 if scenario is _kv_after_wave else 21)
    kv, rows = scenario(tiny_llama)
    owned = {block for _, blocks in rows for block in blocks}
    for block in range(NUM_BLOCKS):
        same = torch.equal(kv.block_bytes(block), untouched.block_bytes(block))
        assert same != (block in owned), f"block {block} (owned={block in owned})"


def test_fill_table_columns_beyond_invocation_or_missing_are_ignored(tiny_llama):
    """Only columns j < min(Wf, S/bs) are written: extra columns and uncovered tokens touch nothing."""
    wide, narrow = _pool(tiny_llama, seed=30), _pool(tiny_llama, seed=30)
    reference = _pool(tiny_llama, seed=30)
    toks = _tokens(64, seed=7)
    # Wider than S/bs: columns 2.. name real blocks that must stay intact.
    _regular_wave(tiny_llama, wide, [(toks, [3, 4, 5, 6])], seq=64, width=4)
    # Narrower than S/bs: the second block of tokens has no column and goes nowhere.
    _regular_wave(tiny_llama, narrow, [(toks, [3])], seq=64, width=1)
    for block in (5, 6):
        assert torch.equal(wide.block_bytes(block), reference.block_bytes(block))
    assert torch.equal(narrow.block_bytes(3), wide.block_bytes(3))
    assert not torch.equal(narrow.block_bytes(3), reference.block_bytes(3))
    assert torch.equal(narrow.block_bytes(4), reference.block_bytes(4))
    assert not torch.equal(wide.block_bytes(4), reference.block_bytes(4))


# ---------------------------------------------------------------- what a chunked step reads


@pytest.mark.parametrize(("fixed_shape", "widths"), [(False, [4, 4]), (True, [8] * 4)], ids=["eager", "fixed_shape"])
def test_chunk_gathers_only_its_prefix_unless_shapes_must_stay_fixed(tiny_llama, monkeypatch, fixed_shape, widths):
    """Chunks at 0 and 128 of a 12-column table: eagerly 0 then 4 columns a layer, fixed-shape 12 - 128/32 each time."""
    kv, gathered = _pool(tiny_llama), []
    gather = kv.gather

    def spy(layer, table):
        gathered.append(table.shape[1])
        return gather(layer, table)

    monkeypatch.setattr(kv, "gather", spy)
    _chunked_row(
        tiny_llama,
        kv,
        _tokens(200, seed=9),
        LONG_BLOCKS[:7],
        chunk=128,
        first=0,
        read_width=12,
        fixed_shape=fixed_shape,
    )
    assert gathered == widths


@READS
def test_chunked_wave_with_different_starts_gives_each_row_its_own_result(tiny_llama, fixed_shape):
    """A cached row's chunk at 128 and a fresh row's chunk at 0, run as one wave, each match running alone."""
    cached_toks, cached_blocks = _tokens(230, seed=3), LONG_BLOCKS[:8]
    fresh_toks, fresh_blocks = _tokens(100, seed=10), [1, 3, 7, 21]
    tokens = torch.zeros(2, 128, dtype=torch.int64)
    tokens[0, :102], tokens[1, :100] = cached_toks[128:], fresh_toks
    fill = torch.tensor([cached_blocks[4:], fresh_blocks], dtype=torch.int32)
    read = torch.tensor([cached_blocks, fresh_blocks + [0] * 4], dtype=torch.int32)
    pools = [_pool(tiny_llama, seed=40) for _ in range(3)]
    for kv in pools:
        _regular_wave(tiny_llama, kv, [(cached_toks[:128], cached_blocks[:4])], seq=128, width=4)
    wave = tiny_llama.forward_hidden(tokens, torch.tensor([128, 0]), fill, read, pools[0], fixed_shape=fixed_shape)
    for row, start in enumerate((128, 0)):
        alone = tiny_llama.forward_hidden(
            tokens[row : row + 1],
            torch.tensor([start]),
            fill[row : row + 1],
            read[row : row + 1],
            pools[row + 1],
            fixed_shape=fixed_shape,
        )
        _assert_close(wave[row], alone[0])


# ---------------------------------------------------------------- loading


def test_save_then_load_round_trips_weights_exactly(tiny_llama, tiny_llama_dir, hf_tiny_llama):
    """A saved folder loads back to identical tensors, and HF reads the very same weights."""
    loaded = load_hf_folder(tiny_llama_dir)
    assert loaded.config == tiny_llama.config
    original = tiny_llama.state_dict()
    assert loaded.state_dict().keys() == original.keys()
    hf_weights = hf_tiny_llama.state_dict()
    for name, tensor in original.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
        assert torch.equal(hf_weights[name], tensor), name


def test_sharded_folder_loads_same_weights_as_single_file(tiny_llama, tiny_llama_dir, tmp_path):
    """A checkpoint split over two shards with an index json loads to the same tensors."""
    names = sorted(tiny_llama.state_dict())
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in halves.items():
        save_file({n: tiny_llama.state_dict()[n].contiguous() for n in shard_names}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    loaded = load_hf_folder(tmp_path).state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in tiny_llama.state_dict().items())


# ---------------------------------------------------------------- CUDA graph


def _graph_chunk_inputs(tokens: torch.Tensor, start: int, blocks: list[int], device):
    piece = tokens[start : start + 64][None].to(device)
    fill = torch.tensor([blocks[start // BS : start // BS + 2]], dtype=torch.int32, device=device)
    return piece, torch.tensor([start], device=device), fill


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for graph capture")
def test_forward_hidden_replays_under_cuda_graph_with_new_start():
    """A captured chunked step replayed with a different start matches eager execution."""
    device = torch.device("cuda")
    model = random_llama(0, "tiny", device=device)
    toks, blocks = _tokens(128, seed=8), [3, 7, 1, 9]
    read = torch.tensor([blocks + [0] * 4], dtype=torch.int32, device=device)
    eager_kv, graph_kv = model.new_kv_cache(16, BS), model.new_kv_cache(16, BS)
    static = [t.clone() for t in _graph_chunk_inputs(toks, 0, blocks, device)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as CUDA graphs require
        model.forward_hidden(*static, read, graph_kv)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.forward_hidden(*static, read, graph_kv)
    for start in (0, 64):
        for buf, value in zip(static, _graph_chunk_inputs(toks, start, blocks, device)):
            buf.copy_(value)
        graph.replay()
        eager = model.forward_hidden(*_graph_chunk_inputs(toks, start, blocks, device), read, eager_kv)
        torch.cuda.synchronize()
        _assert_close(out, eager)
    _assert_close(graph_kv.snapshot(), eager_kv.snapshot())
