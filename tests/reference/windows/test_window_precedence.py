"""Window fields resolve as transformers resolves them (issue 50 class 1's sibling: keys that interact).

``sliding_window``, ``use_sliding_window``, ``max_window_layers`` and
``layer_types`` each present, absent or null in a raw ``config.json`` of
Mistral, Qwen2 or Qwen3: the window and the sliding layers the project
reads (``config.sliding_layers``) equal what transformers' own config class
makes of the same dict and its attention applies (Qwen2/Qwen3:
``config.sliding_window`` on the layers ``config.layer_types`` marks;
Mistral: ``config.sliding_window`` on every layer), a window no shorter than
``max_position_embeddings`` counting as none (it hides no key). Where
transformers keeps sliding ``layer_types`` without a window (Qwen with
``use_sliding_window`` off or a null window), its model raises on the first
forward: the reader refuses that config by name instead of running full attention.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_core import PrefillConfigError
from prefill_shell.reference.llama_like.config import sliding_layers

transformers = pytest.importorskip("transformers")

LAYERS = 3
MAX_POSITION = 64
CLASSES = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
ABSENT = object()
TYPES = st.sampled_from(["full_attention", "sliding_attention"])


@st.composite
def raw_configs(draw):
    family = draw(st.sampled_from(sorted(CLASSES)))
    cfg = dict(
        model_type=family,
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=MAX_POSITION,
    )
    fields = {
        "sliding_window": st.sampled_from([ABSENT, None, 4, 16, MAX_POSITION, 500]),
        "use_sliding_window": st.sampled_from([ABSENT, True, False]),
        "max_window_layers": st.sampled_from([ABSENT, 0, 1, 2, LAYERS]),
        "layer_types": st.one_of(st.just(ABSENT), st.lists(TYPES, min_size=LAYERS, max_size=LAYERS)),
    }
    if family == "mistral":  # Mistral has no switch and ignores layer_types (it warns); keep what it reads
        fields = {"sliding_window": fields["sliding_window"]}
    for key, values in fields.items():
        value = draw(values)
        if value is not ABSENT:
            cfg[key] = value
    return family, cfg


REFUSED = "refused"
MODELS = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}


def _refuses(family: str, config) -> bool:
    """Whether transformers' own model, built from ``config``, raises on a forward (it keeps sliding layer types
    without a window and fails to find one)."""
    import torch

    try:
        with torch.no_grad():
            MODELS[family](config).eval()(torch.zeros(1, 4, dtype=torch.long))
    except (ValueError, TypeError):
        return True
    return False


def _transformers_reading(family: str, cfg: dict) -> tuple[int | None, list[int]] | str:
    config = CLASSES[family](**{k: v for k, v in cfg.items() if k != "model_type"})
    window = config.sliding_window
    if window is None and family != "mistral" and "sliding_attention" in config.layer_types:
        assert _refuses(family, config), cfg  # the oracle's reason, checked on transformers' model itself
        return REFUSED
    if window is None or window >= MAX_POSITION:
        return None, []
    if family == "mistral":
        return window, list(range(LAYERS))
    layers = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    return (window, layers) if layers else (None, [])


@settings(max_examples=300, deadline=None)
@given(raw_configs())
def test_the_window_and_sliding_layers_are_transformers(case):
    family, cfg = case
    expected = _transformers_reading(family, cfg)
    if expected == REFUSED:  # refused by name (the key and its value), as transformers refuses it
        with pytest.raises(PrefillConfigError, match=r"config.json layer_types=\[.*\] is invalid"):
            sliding_layers(cfg)
        return
    try:
        ours = sliding_layers(cfg)
    except PrefillConfigError as error:
        raise AssertionError(f"{cfg}: refused ({error}) where transformers reads {expected}") from None
    assert ours == expected, cfg
