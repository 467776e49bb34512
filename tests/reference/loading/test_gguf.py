"""``load_gguf`` on small GGUF files these tests write with ``gguf.GGUFWriter``.

The oracle is transformers' own GGUF loader (its dequantization and its
undoing of the converters' Q/K row order) on the same file; the permutation
is also checked against a converter-side permutation written here.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from prefill_core.values.errors import PrefillConfigError
from prefill_shell.reference.loading.gguf import load_gguf
from prefill_shell.reference.loading.smollm2 import (
    ModelChecksumError,
    ModelFileMissingError,
    check_sha256,
    smollm2_path,
)

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

# Every matrix row is a multiple of 256 values, the K-quants' block.
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 4, 2, 64, 96
LAYER_SHAPES = {
    "attn_norm": (HIDDEN,),
    "ffn_norm": (HIDDEN,),
    "attn_q": (HEADS * HEAD_DIM, HIDDEN),
    "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_output": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate": (INTER, HIDDEN),
    "ffn_up": (INTER, HIDDEN),
    "ffn_down": (HIDDEN, INTER),
}
MIXED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)


def converter_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF rows -> GGUF rows as converters write them: per head, the pair (i, i + D/2) becomes rows (2i, 2i + 1)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    out = np.empty_like(weight)
    for head in range(num_heads):
        base = head * head_dim
        for i in range(head_dim // 2):
            out[base + 2 * i] = weight[base + i]
            out[base + 2 * i + 1] = weight[base + head_dim // 2 + i]
    return out


K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _encode(values: np.ndarray, qtype, rng) -> tuple[np.ndarray, dict]:
    """The bytes to store; a K-quant (which gguf cannot quantize) gets random blocks instead of ``values``."""
    if qtype in K_QUANTS:
        # Every byte <= 0x3b keeps each fp16 scale finite and below 1.
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = values.shape
        return rng.integers(0, 0x3C, (rows, cols // block * size), dtype=np.uint8), {"raw_dtype": qtype}
    if qtype == Q.F32:
        return values, {}
    if qtype == Q.F16:
        return values.astype(np.float16), {}
    return gguf.quants.quantize(values, qtype), {"raw_dtype": qtype}


def write_llama_gguf(
    path,
    *,
    layers=2,
    types=MIXED_TYPES,
    tied=True,
    arch="llama",
    extra=None,
    seed=0,
    name=None,
    permute=True,
    context=512,
):
    """Writes a tiny random Llama-shaped GGUF; returns its HF-layout float32 weights before quantization.

    ``permute``: store Q/K rows as llama converters do (qwen2/qwen3 converters do not); ``name``: general.name.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    if arch != "llama":
        writer.add_key_length(HEAD_DIM)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(50000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    tensors = {"token_embd": (VOCAB, HIDDEN), "output_norm": (HIDDEN,)}
    if not tied:
        tensors["output"] = (VOCAB, HIDDEN)
    tensors.update({f"blk.{i}.{n}": s for i in range(layers) for n, s in LAYER_SHAPES.items()})
    originals = {}
    for index, (name, shape) in enumerate(tensors.items()):
        values = (rng.standard_normal(shape) * 0.2 + (1.0 if len(shape) == 1 else 0.0)).astype(np.float32)
        originals[name] = values
        qtype = Q.F32 if len(shape) == 1 else types[index % len(types)]
        # Rows quantize independently, so permuting stored rows (bytes or values) is the converters' permutation.
        data, kwargs = _encode(values, qtype, rng)
        if permute and name.endswith("attn_q"):
            data = converter_permute(data, HEADS)
        elif permute and name.endswith("attn_k"):
            data = converter_permute(data, KV_HEADS)
        writer.add_tensor(f"{name}.weight", data, **kwargs)
    for name, (data, kwargs) in (extra or {}).items():
        writer.add_tensor(name, data, **kwargs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_weights_equal_transformers_gguf_loader(tmp_path):
    """Every tensor of a mixed F32/F16/BF16/Q8_0/Q4_0/Q4_1 file equals transformers' dequantized, unpermuted tensor."""
    path = tmp_path / "mixed.gguf"
    write_llama_gguf(path, tied=False)
    ours = load_gguf(path).state_dict()
    theirs = _hf(path).state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_qk_rows_return_to_hf_order(tmp_path):
    """F32 Q/K written in converter order come back exactly as the HF-layout weights the file was made from."""
    path = tmp_path / "f32.gguf"
    originals = write_llama_gguf(path, types=(Q.F32,))
    weights = load_gguf(path).state_dict()
    for layer in range(2):
        for gguf_name, hf_name in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
            expected = torch.from_numpy(originals[f"blk.{layer}.{gguf_name}"])
            assert torch.equal(weights[f"model.layers.{layer}.self_attn.{hf_name}.weight"], expected)


def test_logits_match_transformers_on_the_same_file(tmp_path):
    """Last-token logits of a 40-token prompt match transformers' model loaded from the same GGUF within 1e-4."""
    path = tmp_path / "mixed.gguf"
    write_llama_gguf(path)
    model, hf = load_gguf(path), _hf(path)
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    kv = model.new_kv_cache(num_blocks=4, block_size=16)
    padded = torch.zeros(1, 48, dtype=torch.int64)
    padded[0, :40] = tokens[0]
    hidden = model.forward_hidden(padded, torch.tensor([0]), torch.tensor([[0, 1, 2]]), None, kv)
    ours = model.lm_head(hidden[0, 39:40])[0]
    with torch.no_grad():
        theirs = hf(tokens).logits[0, -1]
    assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()


def test_spec_comes_from_metadata(tmp_path):
    """The spec holds the file's float32 eps verbatim, its RoPE theta, context length, vocab and tying."""
    tied, untied = tmp_path / "tied.gguf", tmp_path / "untied.gguf"
    write_llama_gguf(tied, layers=1)
    write_llama_gguf(untied, layers=1, tied=False)
    spec = load_gguf(tied).config
    assert spec.rms_norm_eps == float(np.float32(1e-5)) != 1e-5
    assert (spec.rope_theta, spec.max_position_embeddings, spec.vocab_size) == (50000.0, 512, VOCAB)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (1, HEADS, KV_HEADS, HEAD_DIM)
    assert spec.tie_word_embeddings and not load_gguf(untied).config.tie_word_embeddings


def test_dtype_argument_casts_the_weights(tmp_path):
    """``dtype=torch.bfloat16`` gives a bfloat16 model whose weights are the float32 ones rounded."""
    path = tmp_path / "f32.gguf"
    originals = write_llama_gguf(path, layers=1, types=(Q.F32,))
    model = load_gguf(path, dtype=torch.bfloat16)
    assert model.config.dtype == "bfloat16"
    expected = torch.from_numpy(originals["blk.0.ffn_up"]).to(torch.bfloat16)
    assert torch.equal(model.state_dict()["model.layers.0.mlp.up_proj.weight"], expected)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_load_like_transformers(tmp_path, qtype):
    """Every tensor of a K-quant file (random blocks, finite scales) equals transformers' dequantized tensor."""
    path = tmp_path / f"{qtype.name}.gguf"
    write_llama_gguf(path, layers=1, types=(qtype,))
    ours = load_gguf(path).state_dict()
    theirs = _hf(path).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert torch.isfinite(ours["model.layers.0.mlp.up_proj.weight"]).all()


def test_an_architecture_not_computed_is_refused_by_name(tmp_path):
    """A GGUF whose general.architecture is not llama, qwen2 or qwen3 raises PrefillConfigError naming it."""
    path = tmp_path / "gemma.gguf"
    write_llama_gguf(path, layers=1, arch="gemma")
    with pytest.raises(PrefillConfigError, match="general.architecture='gemma' is unsupported"):
        load_gguf(path)


def test_quant_type_gguf_cannot_dequantize_is_refused_by_name(tmp_path):
    """A Q8_1 tensor (no dequantizer in the gguf package) raises PrefillConfigError naming the type and tensor."""
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((HIDDEN, HIDDEN // block * size), dtype=np.uint8)
    path = tmp_path / "q8_1.gguf"
    write_llama_gguf(path, layers=1, tied=True, extra={"output.weight": (raw, {"raw_dtype": Q.Q8_1})})
    with pytest.raises(PrefillConfigError, match="'output.weight' has quant type Q8_1"):
        load_gguf(path)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        ("rope_freqs.weight", "RoPE scaling"),
        ("blk.0.attn_rot_embd.weight", "'blk.0.attn_rot_embd.weight' has no place in the reference model"),
    ],
)
def test_unknown_or_scaling_tensors_are_refused(tmp_path, tensor, message):
    """A RoPE-frequency tensor or a tensor with no Llama meaning raises PrefillConfigError naming it."""
    path = tmp_path / "extra.gguf"
    write_llama_gguf(path, layers=1, extra={tensor: (np.ones(HEAD_DIM // 2, dtype=np.float32), {})})
    with pytest.raises(PrefillConfigError, match=message):
        load_gguf(path)


def test_missing_gguf_file_is_a_config_error(tmp_path):
    """load_gguf on a path with no file raises PrefillConfigError naming the path."""
    with pytest.raises(PrefillConfigError, match="nothing.gguf does not exist"):
        load_gguf(tmp_path / "nothing.gguf")


def test_locator_names_a_missing_model_and_how_to_fetch_it(tmp_path, monkeypatch):
    """PREFILL_SMOLLM2 naming an absent file raises ModelFileMissingError that says to run make model."""
    monkeypatch.setenv("PREFILL_SMOLLM2", str(tmp_path / "gone.gguf"))
    with pytest.raises(ModelFileMissingError, match=r"gone.gguf does not exist: run `make model`"):
        smollm2_path()


def test_locator_falls_back_to_the_cache_path_of_ensure_model(tmp_path, monkeypatch):
    """Without PREFILL_SMOLLM2 the locator looks where scripts/ensure-model.sh writes (PREFILL_MODEL_DIR here)."""
    monkeypatch.delenv("PREFILL_SMOLLM2", raising=False)
    monkeypatch.setenv("PREFILL_MODEL_DIR", str(tmp_path))
    with pytest.raises(ModelFileMissingError, match=str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")):
        smollm2_path()


def test_locator_rejects_a_file_with_another_checksum(tmp_path, monkeypatch):
    """A model file whose bytes differ from the pinned ones raises ModelChecksumError naming both digests."""
    corrupt = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.setenv("PREFILL_SMOLLM2", str(corrupt))
    actual = hashlib.sha256(corrupt.read_bytes()).hexdigest()
    with pytest.raises(ModelChecksumError, match=f"sha256 {actual}, expected b179c952"):
        smollm2_path()
    assert smollm2_path(verify=False) == corrupt


def test_checksum_accepts_matching_bytes(tmp_path):
    """check_sha256 returns quietly when the digest matches, so the rejection above is about the bytes."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"prefill")
    check_sha256(path, hashlib.sha256(b"prefill").hexdigest())


def _family_extras(arch: str, layers: int, seed: int) -> dict:
    """Qwen2's q/k/v biases and Qwen3's q/k norms, as F32 tensors."""
    rng = np.random.default_rng(seed + 100)
    shapes = {"attn_q.bias": HEADS * HEAD_DIM, "attn_k.bias": KV_HEADS * HEAD_DIM, "attn_v.bias": KV_HEADS * HEAD_DIM}
    if arch == "qwen3":
        shapes = {"attn_q_norm.weight": HEAD_DIM, "attn_k_norm.weight": HEAD_DIM}
    return {
        f"blk.{i}.{name}": ((rng.standard_normal(n) * 0.2 + (0.0 if "bias" in name else 1.0)).astype(np.float32), {})
        for i in range(layers)
        for name, n in shapes.items()
    }


def test_qwen2_gguf_logits_equal_transformers_reading_it_unpermuted(tmp_path):
    """A qwen2 GGUF (q/k/v biases, Q/K rows as converters write them: unpermuted): logits equal transformers'."""
    path = tmp_path / "qwen2.gguf"
    write_llama_gguf(path, layers=2, types=(Q.F32,), arch="qwen2", permute=False, extra=_family_extras("qwen2", 2, 0))
    model, hf = load_gguf(path), _hf(path)
    assert model.config.family == "qwen2" and model.config.attention.qkv_bias
    tokens = torch.randint(1, VOCAB, (1, 32), generator=torch.Generator().manual_seed(4))
    kv = model.new_kv_cache(2, 32)
    table = torch.tensor([[0]], dtype=torch.int32)
    ours = model.lm_head(model.forward_hidden(tokens, torch.tensor([0]), table, None, kv)[:, -1])[0]
    with torch.no_grad():
        theirs = hf(tokens).logits[0, -1]
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_qwen3_gguf_weights_are_read_unpermuted_with_the_files_head_dim(tmp_path):
    """A qwen3 GGUF: every tensor (q/k norms included) equals what was written, unpermuted, and head_dim is the
    file's attention.key_length. (transformers reads no head_dim from a qwen3 file and takes Qwen3Config's 128,
    so on this 64-wide file it cannot be the oracle; a real Qwen3's heads are 128 wide, where both agree.)"""
    path = tmp_path / "qwen3.gguf"
    extras = _family_extras("qwen3", 1, 0)
    originals = write_llama_gguf(path, layers=1, types=(Q.F32,), arch="qwen3", permute=False, extra=extras)
    model = load_gguf(path)
    assert model.config.family == "qwen3" and model.config.attention.qk_norm and model.config.head_dim == HEAD_DIM
    weights = model.state_dict()
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(originals["blk.0.attn_q"]))
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(originals["blk.0.attn_k"]))
    norm = torch.from_numpy(extras["blk.0.attn_k_norm.weight"][0])
    assert torch.equal(weights["model.layers.0.self_attn.k_norm.weight"], norm)


def test_a_llama_gguf_named_mistral_is_read_as_mistral_with_its_default_window(tmp_path):
    """general.name 'mistral' makes transformers read Mistral, whose default window (4096) the reference refuses
    once the context is longer; within a 512-token context the window hides nothing and the file loads."""
    path = tmp_path / "mistral.gguf"
    write_llama_gguf(path, layers=1, types=(Q.F32,), name="mistral")
    assert load_gguf(path).config.family == "mistral"
    long = tmp_path / "mistral_long.gguf"
    write_llama_gguf(long, layers=1, types=(Q.F32,), name="mistral", context=8192)
    with pytest.raises(PrefillConfigError, match="sliding_window=4096"):
        load_gguf(long)


def test_a_command_parses_a_file_once_and_a_rewritten_file_again(tmp_path, monkeypatch):
    """The tokenizer check and the weights share one parse of a file; rewriting the file parses it anew."""
    from prefill_shell.reference.loading import gguf as module

    path = tmp_path / "once.gguf"
    write_llama_gguf(path, layers=1, types=(Q.F32,), seed=1)
    parses = []
    real = gguf.GGUFReader

    def counted(*args, **kwargs):
        parses.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    assert module.gguf_has_tokenizer(path) is False
    first = load_gguf(path)
    assert len(parses) == 1
    originals = write_llama_gguf(path, layers=1, types=(Q.F32,), seed=2)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    second = load_gguf(path)
    assert len(parses) == 2
    expected = torch.from_numpy(originals["blk.0.ffn_up"])
    assert torch.equal(second.state_dict()["model.layers.0.mlp.up_proj.weight"], expected)
    assert not torch.equal(first.state_dict()["model.layers.0.mlp.up_proj.weight"], expected)
