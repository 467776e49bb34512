"""HF folders load only what the reference Llama computes: other settings and unplaced tensors are named errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefill_core.values.errors import PrefillConfigError
from prefill_shell.reference import load_hf_folder, random_llama, save_hf_folder

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _saved(model, folder):
    model.save_pretrained(folder)
    return folder


def _llama_folder(tmp_path, **overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SIZES, **overrides})
    return _saved(transformers.LlamaForCausalLM(config).eval(), tmp_path / "llama")


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return folder


def test_transformers_written_llama_loads_and_matches_transformers(tmp_path):
    """A folder transformers itself saved (untied and tied) loads and gives transformers' logits."""
    for tied in (False, True):
        torch.manual_seed(1)
        config = transformers.LlamaConfig(**SIZES, tie_word_embeddings=tied)
        hf = transformers.LlamaForCausalLM(config).eval()
        folder = _saved(hf, tmp_path / f"tied{tied}")
        model = load_hf_folder(folder)
        tokens = torch.randint(1, 64, (1, 32), generator=torch.Generator().manual_seed(2))
        kv = model.new_kv_cache(2, 32)
        table = torch.tensor([[0]], dtype=torch.int32)
        hidden = model.forward_hidden(tokens, torch.tensor([0]), table, table, kv)
        with torch.inference_mode():
            expected = hf(tokens).logits[0, -1]
        assert torch.allclose(model.lm_head(hidden[:, -1])[0], expected, atol=1e-4), f"tied={tied}"


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(mlp_bias=True), "mlp_bias=True"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope_type='dynamic'"),
    ],
    ids=["gelu", "mlp_bias", "dynamic_rope"],
)
def test_llama_settings_the_reference_does_not_compute_are_refused(tmp_path, overrides, named):
    """gelu, MLP biases and a RoPE scaling kind not computed are refused, naming key and value."""
    folder = _llama_folder(tmp_path, **overrides)
    with pytest.raises(PrefillConfigError, match=named.replace("(", r"\(")):
        load_hf_folder(folder)


def test_unknown_rope_type_in_config_is_refused(tmp_path):
    """A RoPE scaling type no one implements (edited into config.json) is refused by name."""
    folder = _edit_config(_llama_folder(tmp_path), rope_scaling={"rope_type": "wobbly", "factor": 2.0})
    with pytest.raises(PrefillConfigError, match="rope_type='wobbly'"):
        load_hf_folder(folder)


def test_a_model_type_not_computed_is_refused(tmp_path):
    """A folder whose model_type names another architecture (phi3 here) is refused by model_type."""
    folder = _edit_config(_llama_folder(tmp_path), model_type="phi3", architectures=["Phi3ForCausalLM"])
    with pytest.raises(PrefillConfigError, match="model_type='phi3'"):
        load_hf_folder(folder)


def test_qwen2_biases_under_a_llama_config_are_refused_by_tensor_name(tmp_path):
    """Bias tensors under a config that claims plain Llama are named, never dropped."""
    torch.manual_seed(0)
    folder = _saved(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES)), tmp_path / "qwen2")
    _edit_config(folder, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(PrefillConfigError, match=r"self_attn\.k_proj\.bias"):
        load_hf_folder(folder)


def test_an_extra_tensor_is_named(tmp_path):
    """Any tensor the reference Llama has no place for is an error naming it."""
    folder = save_hf_folder(random_llama(0, "tiny"), tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.extra_scale"] = torch.ones(4)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(PrefillConfigError, match="mlp.extra_scale"):
        load_hf_folder(folder)


def test_tied_head_stored_anyway_must_equal_the_embeddings(tmp_path):
    """A tied config whose checkpoint also stores lm_head loads when it equals the embeddings, else is named."""
    folder = save_hf_folder(random_llama(0, "tiny", tie_word_embeddings=True), tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    load_hf_folder(folder)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(PrefillConfigError, match="lm_head.weight"):
        load_hf_folder(folder)


@pytest.mark.parametrize(
    "damage, named",
    [
        (b"", "model.safetensors"),
        (b"\x00garbage" * 10, "model.safetensors"),
        ("truncate", "model.safetensors"),
    ],
    ids=["empty", "garbage", "truncated"],
)
def test_damaged_safetensors_is_a_named_config_error(tmp_path, damage, named):
    """An empty, garbage or truncated model.safetensors raises PrefillConfigError naming the file."""
    folder = save_hf_folder(random_llama(0, "tiny"), tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else damage)
    with pytest.raises(PrefillConfigError, match=named):
        load_hf_folder(folder)


@pytest.mark.parametrize(
    "text, named",
    [("{not json", "config.json"), ("[1, 2]", "list"), ('{"model_type": "llama"}', "'num_attention_heads'")],
    ids=["garbage", "not_object", "missing_field"],
)
def test_damaged_config_json_is_named(tmp_path, text, named):
    """A config.json that is not JSON, not an object or lacks a field raises PrefillConfigError naming it."""
    folder = save_hf_folder(random_llama(0, "tiny"), tmp_path)
    (folder / "config.json").write_text(text)
    with pytest.raises(PrefillConfigError, match=named):
        load_hf_folder(folder)
