"""Keys a config.json can give in two places resolve as transformers 5 resolves them, by a property over both.

The oracle is transformers' own config class on the same raw dict
(``from_dict``: what ``from_pretrained`` runs on a folder's config.json), and
its RoPE initialisers for the frequencies: RoPE fields inside
``rope_parameters`` / ``rope_scaling`` and beside them, the two RoPE
spellings together, ``dtype`` and ``torch_dtype``, for every family the
loader computes. A mismatch used to be silent: a top-level ``rope_theta``
beat ``rope_parameters.rope_theta`` (logits off by about 3 on a tiny model).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_shell.reference.llama_like.config import LlamaSpec
from prefill_shell.reference.llama_like.llama import rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tests.reference.llama_like.test_config import CONFIGS  # noqa: E402  (the four families' config classes)

SIZES = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
)
THETAS = st.sampled_from([500.0, 10000.0, 1e6])


@st.composite
def rope_tables(draw):
    """A RoPE table of a computed type, each optional key present or not."""
    kind = draw(st.sampled_from(["default", "linear", "llama3", "yarn"]))
    table = {"rope_type": kind}
    if draw(st.booleans()):
        table["rope_theta"] = draw(THETAS)
    if kind != "default":
        table["factor"] = draw(st.sampled_from([2.0, 4.0]))
    if kind == "llama3":
        table.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if kind in ("llama3", "yarn") and (kind == "llama3" or draw(st.booleans())):
        table["original_max_position_embeddings"] = draw(st.sampled_from([128, 256]))
    if draw(st.booleans()):
        table["partial_rotary_factor"] = 1.0
    return table


@st.composite
def configs(draw):
    family = draw(st.sampled_from(sorted(CONFIGS)))
    cfg = {"model_type": family, **SIZES}
    if family == "mistral":
        cfg["sliding_window"] = None
    if draw(st.booleans()):
        cfg["rope_parameters"] = draw(rope_tables())
    if draw(st.booleans()):
        cfg["rope_scaling"] = draw(st.one_of(st.none(), st.just({}), rope_tables()))
    if draw(st.booleans()):
        cfg["rope_theta"] = draw(THETAS)
    if draw(st.booleans()):
        cfg["original_max_position_embeddings"] = 64  # beside the table: it beats the table's at RoPE time
    if draw(st.booleans()):
        cfg["partial_rotary_factor"] = 1.0
    for key in ("dtype", "torch_dtype"):
        if draw(st.booleans()):
            cfg[key] = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    return family, cfg


def _transformers_inv_freq(config) -> torch.Tensor:
    params = config.rope_parameters
    kind = params["rope_type"]
    if kind == "default":  # computed inline by each model's rotary embedding
        dim = config.head_dim
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")[0]


@settings(max_examples=150, deadline=None)
@given(configs())
def test_every_key_given_in_two_places_resolves_as_transformers_resolves_it(case):
    family, cfg = case
    config = CONFIGS[family].from_dict(dict(cfg))
    spec = LlamaSpec.from_hf_dict(dict(cfg))
    assert spec.rope_theta == float(config.rope_parameters["rope_theta"])
    ours = "default" if spec.rope_scaling is None else spec.rope_scaling.to_hf_dict()["rope_type"]
    assert ours == config.rope_parameters["rope_type"]
    assert torch.allclose(rope_inv_freq(spec), _transformers_inv_freq(config), rtol=1e-6, atol=0)
    assert getattr(torch, spec.dtype) == (config.dtype or torch.float32)


def test_rope_parameters_theta_beats_the_top_level_one_as_in_transformers():
    """The quoted case: both placements, the table's theta wins (the top level is a default)."""
    cfg = {**SIZES, "rope_theta": 500.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    for family, config_class in CONFIGS.items():
        spec = LlamaSpec.from_hf_dict({**cfg, "model_type": family, "sliding_window": None})
        assert config_class.from_dict(dict(cfg)).rope_parameters["rope_theta"] == spec.rope_theta == 1e6


# -- Gemma 3's tie flag, at two levels ------------------------------------------------------------------------------

GEMMA3_TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=128,
    sliding_window=16,
)
GEMMA3_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
FLAGS = st.sampled_from([None, True, False])  # None: the key is absent


@st.composite
def gemma3_tie_configs(draw):
    """A raw Gemma 3 config.json with ``tie_word_embeddings`` at the top level, in ``text_config``, both or neither."""
    text, top = dict(GEMMA3_TEXT), {}
    nested = draw(st.booleans())
    for level in (text, top) if nested else (text,):
        flag = draw(FLAGS)
        if flag is not None:
            level["tie_word_embeddings"] = flag
    if not nested:
        return {"model_type": "gemma3_text", **text}
    return {
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": GEMMA3_VISION,
        "mm_tokens_per_image": 4,
        **top,
    }


def _transformers_ties(cfg: dict) -> bool:
    """Whether transformers' own model class, built from ``cfg`` as ``from_pretrained`` builds it, ties its head."""
    if cfg["model_type"] == "gemma3":
        model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config.from_dict(dict(cfg)))
        embeddings = model.model.language_model.embed_tokens
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig.from_dict(dict(cfg)))
        embeddings = model.model.embed_tokens
    return model.lm_head.weight.data_ptr() == embeddings.weight.data_ptr()


@settings(max_examples=30, deadline=None)
@given(gemma3_tie_configs())
def test_gemma3_ties_its_head_by_level_as_transformers_classes_do(cfg):
    """``Gemma3ForConditionalGeneration`` ties by the top-level flag, ``Gemma3ForCausalLM`` by its (text) config's."""
    from prefill_shell.reference.gemma.gemma3_config import Gemma3Spec

    assert Gemma3Spec.from_hf_dict(cfg).tie_word_embeddings == _transformers_ties(cfg), cfg
