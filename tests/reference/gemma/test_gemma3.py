"""Gemma 3 text from Hugging Face folders, as transformers writes them, against transformers' own models.

Three folder shapes: ``Gemma3ForCausalLM`` (``gemma3_text``, transformers 5
spelling, and the same config rewritten in the legacy spelling:
``rope_theta`` + ``rope_scaling``, ``rope_local_base_freq``,
``sliding_window_pattern``), and ``Gemma3ForConditionalGeneration``
(``gemma3``: the text model nested in ``text_config``, its weights under
``language_model.``, beside a vision tower that is not read), in both the
published weight layout and transformers 4.52's; a nested config's logit
cap is refused, since transformers' multimodal model ignores it. Each loads through
``load_hybrid_folder`` and prefills a prompt longer than its window in
chunks; last-token logits equal the transformers model's within 1e-4.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from prefill_core import PageTableLayout
from prefill_core.values.errors import PrefillConfigError
from prefill_shell.reference.gemma.gemma3_config import (
    GEMMA3_COMPUTED_KEYS,
    GEMMA3_INERT_KEYS,
    GEMMA3_REFUSED_KEYS,
    Gemma3Spec,
)
from prefill_shell.reference.windows.hybrid import load_hybrid_folder
from tests import gemma3_kit
from tests import window_kit as kit
from tests.reference.windows.test_windowed import POOL, _run_call

transformers = pytest.importorskip("transformers")

WINDOW = 24


def _logits(folder, prompt: torch.Tensor, sliding_bs: int = 8) -> torch.Tensor:
    model = load_hybrid_folder(folder, block_size=16, sliding_block_size=sliding_bs)
    kv = model.new_kv_cache(POOL)
    tables = kit.fresh_tables(model.attention, [len(prompt)])
    layout = PageTableLayout(16, 32, POOL)
    (logits,) = _run_call(model.model, kv, model.attention, layout, [prompt], [len(prompt)], [0], tables)
    return logits


def _expected(hf, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(prompt[None]).logits[0, -1]


def _legacy(folder) -> None:
    """Rewrites a transformers 5 ``gemma3_text`` config.json in the spelling published checkpoints use."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    full = dict(rope["full_attention"])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    cfg["rope_scaling"] = full
    del cfg["layer_types"]
    cfg["sliding_window_pattern"] = 2  # layers 0, 2 slide; layer 1 is full: the kit's types
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("spelling", ["transformers5", "legacy"])
def test_a_gemma3_text_folder_equals_gemma3_for_causal_lm(spelling, tmp_path):
    """A ``Gemma3ForCausalLM`` folder loads with its window, layer types and both RoPE bases; logits equal."""
    _, hf, _ = gemma3_kit.gemma3_and_oracle(WINDOW)
    hf.save_pretrained(tmp_path)
    if spelling == "legacy":
        _legacy(tmp_path)
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2))
    model = load_hybrid_folder(tmp_path, block_size=16, sliding_block_size=8)
    by_layer = {layer: g.kind.value for g in model.attention.groups for layer in g.layers}
    assert tuple(by_layer[i] for i in range(3)) == gemma3_kit.TYPES
    logits, expected = _logits(tmp_path, prompt), _expected(hf, prompt)
    assert torch.allclose(logits, expected, rtol=kit.TOL, atol=kit.TOL), (logits - expected).abs().max()


def _conditional_generation(tmp_path, layout: str = "published", top_tie=None, text_tie=None):
    """A random tiny ``Gemma3ForConditionalGeneration`` saved to ``tmp_path`` (weights renamed for ``layout``).

    ``top_tie`` / ``text_tie``: ``tie_word_embeddings`` given to ``Gemma3Config`` / its text config (None: not given).
    """
    from safetensors.torch import load_file, save_file

    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    special = dict(image_token_index=255, boi_token_index=253, eoi_token_index=254)
    text_tie = {} if text_tie is None else {"tie_word_embeddings": text_tie}
    top_tie = {} if top_tie is None else {"tie_word_embeddings": top_tie}
    config = transformers.Gemma3Config(
        text_config=gemma3_kit.text_config(WINDOW, final_logit_softcapping=None, **text_tie),
        vision_config=vision,
        mm_tokens_per_image=4,
        **special,
        **top_tie,
    )
    hf = transformers.Gemma3ForConditionalGeneration(config).eval().float()
    gemma3_kit.randomize(hf, 4)
    hf.save_pretrained(tmp_path)
    if layout == "transformers-4.52":  # model.language_model.layers...: what save_pretrained wrote from 4.52 to 5
        path = tmp_path / "model.safetensors"
        tensors = load_file(str(path))
        renamed = {("model." + k.replace("language_model.model.", "language_model.", 1)): v for k, v in tensors.items()}
        save_file(renamed, str(path), metadata={"format": "pt"})
    return hf


@pytest.mark.parametrize("layout", ["published", "transformers-4.52"])
def test_a_nested_gemma3_checkpoint_loads_its_text_model(layout, tmp_path):
    """``text_config`` and ``language_model.`` weights (vision tower not read): text logits equal transformers'."""
    hf = _conditional_generation(tmp_path, layout)
    names = set(json.loads((tmp_path / "config.json").read_text()))
    assert {"text_config", "vision_config"} <= names
    prompt = torch.randint(0, 250, (90,), generator=torch.Generator().manual_seed(3))
    logits, expected = _logits(tmp_path, prompt, sliding_bs=16), _expected(hf, prompt)
    assert torch.allclose(logits, expected, rtol=kit.TOL, atol=kit.TOL), (logits - expected).abs().max()


@pytest.mark.parametrize("top_tie, text_tie", [(False, None), (False, True), (True, False)])
def test_a_nested_gemma3_checkpoint_ties_its_head_by_the_top_level_flag(top_tie, text_tie, tmp_path):
    """``Gemma3ForConditionalGeneration`` ties by ``Gemma3Config.tie_word_embeddings`` and never reads the text
    config's: each placement loads and its logits equal transformers' (a saved untied head was refused, or tied)."""
    hf = _conditional_generation(tmp_path, top_tie=top_tie, text_tie=text_tie)
    tied = hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    assert tied == top_tie  # transformers' own reading, which the loader must equal
    prompt = torch.randint(0, 250, (60,), generator=torch.Generator().manual_seed(5))
    logits, expected = _logits(tmp_path, prompt, sliding_bs=16), _expected(hf, prompt)
    assert torch.allclose(logits, expected, rtol=kit.TOL, atol=kit.TOL), (logits - expected).abs().max()


def _raises_on_forward(hf) -> bool:
    try:
        with torch.no_grad():
            hf(torch.zeros(1, 8, dtype=torch.long))
    except (ValueError, TypeError):
        return True
    return False


@pytest.mark.parametrize("nested", [False, True], ids=["gemma3_text", "gemma3"])
def test_a_null_gemma3_window_is_refused_by_name_as_transformers_refuses_it(nested, tmp_path):
    """``sliding_window: null`` with sliding layers: transformers' model raises on its first forward; the loader
    refuses it naming the folder, the key and the value (it used to read transformers' default 4096)."""
    _, hf, _ = gemma3_kit.gemma3_and_oracle(WINDOW)
    if nested:
        _conditional_generation(tmp_path)
    else:
        hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    (cfg["text_config"] if nested else cfg)["sliding_window"] = None
    path.write_text(json.dumps(cfg))
    oracle = transformers.AutoConfig.from_pretrained(tmp_path)
    text = oracle.text_config if nested else oracle
    assert text.sliding_window is None and _raises_on_forward(transformers.Gemma3ForCausalLM(text).eval())
    with pytest.raises(PrefillConfigError, match=r"config.json sliding_window=None is invalid") as raised:
        load_hybrid_folder(tmp_path, block_size=16)
    assert str(path) in str(raised.value)
    # Absent, it is transformers' default: 4096.
    del (cfg["text_config"] if nested else cfg)["sliding_window"]
    assert Gemma3Spec.from_hf_dict(cfg).sliding_window == 4096 == transformers.Gemma3TextConfig().sliding_window


def test_every_key_of_gemma3s_text_config_is_computed_inert_or_refused(tmp_path):
    """Each field of ``Gemma3TextConfig``, and each key it writes, is in exactly one of the three tables."""
    config = gemma3_kit.text_config(WINDOW)
    config.save_pretrained(tmp_path)
    written = set(json.loads((tmp_path / "config.json").read_text()))
    keys = {f.name for f in dataclasses.fields(transformers.Gemma3TextConfig)} | written
    tables = (GEMMA3_COMPUTED_KEYS, GEMMA3_INERT_KEYS, set(GEMMA3_REFUSED_KEYS))
    assert not sorted(k for k in keys if sum(k in t for t in tables) != 1)
    spec = Gemma3Spec.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    assert Gemma3Spec.from_hf_dict(spec.to_hf_dict()) == spec


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters="),
        ({"layer_types": ["sliding_attention"]}, "layer_types="),
        ({"model_type": "gemma3", "text_config": None}, "text_config=None"),
        # transformers' Gemma3ForConditionalGeneration ignores the cap its text config names
        ({"model_type": "gemma3", "text_config": {"final_logit_softcapping": 30.0}}, "final_logit_softcapping=30.0"),
    ],
)
def test_a_gemma3_setting_not_computed_is_refused_by_name(changes, named):
    """A config the reference Gemma 3 would load and compute differently is a named ``PrefillConfigError``."""
    cfg = {**gemma3_kit.text_config(WINDOW).to_dict(), **changes}
    with pytest.raises(PrefillConfigError, match=named.replace("[", r"\[").replace("(", r"\(")):
        Gemma3Spec.from_hf_dict(cfg)


def test_a_gemma3_checkpoint_with_a_tensor_it_does_not_compute_is_refused(tmp_path):
    """A stray text tensor (a bias config.json does not describe) is named, not dropped."""
    from safetensors.torch import load_file, save_file

    _, hf, _ = gemma3_kit.gemma3_and_oracle(WINDOW)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(PrefillConfigError, match=r"q_proj\.bias"):
        load_hybrid_folder(tmp_path, block_size=16)
