"""What the loader reads from Llama, Mistral, Qwen2 and Qwen3 configs, and every key it refuses, by name."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from prefill_core.values.errors import PrefillConfigError
from prefill_shell.reference.llama_like.config import (
    COMPUTED_KEYS,
    INERT_KEYS,
    REFUSED_KEYS,
    LayerAttention,
    read_config_json,
)
from prefill_shell.reference.llama_like.llama import rope_inv_freq
from prefill_shell.reference.llama_like.rope import COMPUTED_ROPE_TYPES, YarnRopeScaling

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def _read(tmp_path, family: str, **overrides):
    """The spec read from the config.json transformers writes for ``family`` with ``overrides``."""
    defaults = {"sliding_window": None} if family == "mistral" else {}
    CONFIGS[family](**{**SIZES, **defaults, **overrides}).save_pretrained(tmp_path)
    return read_config_json(tmp_path)


def _edited(tmp_path, family: str, **changes):
    """The spec read after editing ``changes`` into a transformers-written config.json (keys it would not write)."""
    _read(tmp_path, family)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return read_config_json(tmp_path)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_key_of_the_families_configs_is_computed_inert_or_refused(family, tmp_path):
    """Each field of the family's config class, and each key it writes, is in exactly one of the three tables."""
    defaults = {"sliding_window": None} if family == "mistral" else {}
    CONFIGS[family](**{**SIZES, **defaults}).save_pretrained(tmp_path)
    written = set(json.loads((tmp_path / "config.json").read_text()))
    keys = {f.name for f in dataclasses.fields(CONFIGS[family])} | written
    tables = (COMPUTED_KEYS, INERT_KEYS, set(REFUSED_KEYS))
    unclassified = sorted(k for k in keys if sum(k in t for t in tables) != 1)
    assert not unclassified


def test_the_tables_are_disjoint():
    """No key is both computed and inert, or computed and refused."""
    assert not (COMPUTED_KEYS & INERT_KEYS) and not (set(REFUSED_KEYS) & (COMPUTED_KEYS | INERT_KEYS))


REFUSED = [
    # (family, transformers config overrides or edits, the key and value the error names)
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen2", dict(hidden_act="relu"), "hidden_act='relu'"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True"),
    ("qwen3", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("mistral", dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config="),
    ("qwen2", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic'"),
    ("qwen3", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}), "'longrope'"),
    ("mistral", dict(sliding_window=64), "sliding_window=64"),
    # layer_types null: transformers derives them from max_window_layers, as the reader does
    (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=64, max_window_layers=1, layer_types=None),
        r"sliding_window=64.*\[1, 2\]",
    ),
    (
        "qwen3",
        dict(
            use_sliding_window=True,
            sliding_window=32,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        ),
        r"sliding_window=32.*\[1\]",
    ),
    ("qwen2", dict(model_type="gemma"), "model_type='gemma'"),
    ("qwen3", dict(architectures=["Qwen2ForCausalLM"]), "'Qwen2ForCausalLM'"),
]


@pytest.mark.parametrize("family, changes, named", REFUSED, ids=[f"{f}-{next(iter(c))}" for f, c, _ in REFUSED])
def test_every_setting_not_computed_is_refused_by_name(tmp_path, family, changes, named):
    """Each key these families' configs carry that the reference does not compute is a PrefillConfigError naming it."""
    with pytest.raises(PrefillConfigError, match=named):
        _edited(tmp_path, family, **changes)


def test_mistral_without_a_sliding_window_key_takes_transformers_default_window(tmp_path):
    """A Mistral config.json with no sliding_window key means transformers' 4096: refused, not read as none."""
    _read(tmp_path, "mistral", max_position_embeddings=8192)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PrefillConfigError, match="sliding_window=4096"):
        read_config_json(tmp_path)


@pytest.mark.parametrize(
    "family, changes",
    [
        ("qwen2", dict(sliding_window=131072, use_sliding_window=False, max_window_layers=21)),  # as Qwen2.5 ships
        ("qwen3", dict(sliding_window=None, use_sliding_window=False)),
        (
            "qwen2",
            dict(sliding_window=64, use_sliding_window=True, max_window_layers=3, layer_types=None),
        ),  # none from 3
        ("mistral", dict(sliding_window=None)),
        ("mistral", dict(sliding_window=256)),  # as long as max_position_embeddings: hides no key
    ],
    ids=["qwen2.5-flag-off", "qwen3-none", "qwen2-no-layer", "mistral-none", "mistral-covers-all"],
)
def test_a_window_that_hides_nothing_loads_as_full_attention(tmp_path, family, changes):
    """Windows transformers does not apply, or that reach every position, load as full attention: the plain model
    (no layer in a window), and last logits on a prompt longer than every window below the context equal
    transformers' on the same checkpoint."""
    from prefill_shell.reference import PagedLlama, load_model_folder
    from prefill_shell.reference.llama_like.config import sliding_layers
    from tests import family_kit
    from tests.helpers import build_runtime

    defaults = {"sliding_window": None} if family == "mistral" else {}
    hf = getattr(transformers, f"{family_kit.CLASSES[family]}ForCausalLM")(CONFIGS[family](**{**SIZES, **defaults}))
    family_kit.randomize(hf.eval(), 7)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    assert sliding_layers(json.loads(path.read_text())) == (None, [])
    model = load_model_folder(tmp_path)
    assert isinstance(model, PagedLlama) and getattr(model, "attention", None) is None
    prompt = torch.randint(0, SIZES["vocab_size"], (100,), generator=torch.Generator().manual_seed(1))
    runtime = build_runtime(model, num_blocks=8, block_size=16)
    (result,) = runtime.prefill(prompt[None], torch.arange(7, dtype=torch.int32)[None], [len(prompt)])
    oracle = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = oracle(prompt[None]).logits[0, -1]
    assert torch.allclose(result.logits, expected, rtol=1e-4, atol=1e-4), (result.logits - expected).abs().max()


def test_family_options_are_read_from_the_checkpoint(tmp_path):
    """Biases, Q/K norms, head_dim and the tied head come from each family's config as transformers reads it."""
    qwen2 = _read(tmp_path / "q2", "qwen2", tie_word_embeddings=True)
    assert qwen2.attention == LayerAttention(qkv_bias=True) and qwen2.tie_word_embeddings and qwen2.head_dim == 8
    qwen3 = _read(tmp_path / "q3", "qwen3", head_dim=16, attention_bias=True)
    assert qwen3.attention == LayerAttention(qkv_bias=True, o_bias=True, qk_norm=True) and qwen3.head_dim == 16
    mistral = _read(tmp_path / "m", "mistral", head_dim=12)
    assert mistral.attention == LayerAttention() and mistral.head_dim == 12
    llama = _read(tmp_path / "l", "llama", attention_bias=True)
    assert llama.attention == LayerAttention(qkv_bias=True, o_bias=True)
    # Qwen3's config class defaults head_dim to 128, not hidden / heads.
    path = tmp_path / "q3" / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["head_dim"]
    path.write_text(json.dumps(cfg))
    assert read_config_json(tmp_path / "q3").head_dim == 128


ROPES = [
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 5e5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0.8},
    {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "truncate": False},
]


@pytest.mark.parametrize("params", ROPES, ids=lambda p: "-".join(f"{k}" for k in p if k != "rope_theta"))
def test_computed_rope_types_equal_transformers_frequencies_and_attention_factor(tmp_path, params):
    """Every computed RoPE type gives transformers' inverse frequencies and cos/sin scale, from rope_parameters."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert params["rope_type"] in COMPUTED_ROPE_TYPES
    config = transformers.Qwen3Config(**{**SIZES, "head_dim": 16}, rope_parameters=dict(params))
    config.save_pretrained(tmp_path)
    spec = read_config_json(tmp_path)
    kind = params["rope_type"]
    if kind == "default":  # transformers computes it inline in each model's rotary embedding
        expected, factor = 1.0 / (params["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16)), 1.0
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    assert torch.allclose(rope_inv_freq(spec), expected, rtol=1e-6, atol=0)
    assert math.isclose(spec.rope_attention_factor, factor, rel_tol=1e-12)


def test_legacy_rope_spelling_reads_as_rope_parameters(tmp_path):
    """rope_theta at the top level plus a rope_scaling dict reads the same scaling as rope_parameters."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    new = _edited(tmp_path / "new", "qwen2", rope_parameters={**yarn, "rope_theta": 1e6})
    old = _edited(tmp_path / "old", "qwen2", rope_parameters=None, rope_theta=1e6, rope_scaling=yarn)
    assert isinstance(old.rope_scaling, YarnRopeScaling) and (old.rope_theta, old.rope_scaling) == (
        new.rope_theta,
        new.rope_scaling,
    )
