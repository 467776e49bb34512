"""One way in: every folder loader reads config.json through one reader, and ``load_model_folder`` serves any folder.

A damaged folder (missing, no or a directory ``config.json``, text that is
not UTF-8 or not JSON, JSON that is not an object) is the same named
``PrefillConfigError`` from every loader and changes nothing in it.
``load_hf_folder`` on a folder transformers slides (Mistral, Qwen2, Qwen3
with a window, Gemma 3) names ``load_model_folder``; ``load_model_folder``
returns the model that computes it, and the serving facade
``serving_facade`` picks for it serves it as vLLM's plugin calls it: last
logits equal transformers' on the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefill_core import PrefillConfigError, PrefillPolicy, vllm_layer_groups
from prefill_shell.backends.torch_backend import TorchBackend
from prefill_shell.reference import PagedLlama, load_hf_folder, load_model_folder, read_config_json
from prefill_shell.reference.loading.model_folder import read_model_folder_spec
from prefill_shell.reference.windows.hybrid import HybridLlama, load_hybrid_folder
from prefill_shell.serving import HybridServingFacade, serving_facade
from tests import family_kit, gemma3_kit

transformers = pytest.importorskip("transformers")

LOADERS = {
    "read_config_json": read_config_json,
    "load_hf_folder": load_hf_folder,
    "load_hybrid_folder": lambda folder: load_hybrid_folder(folder, block_size=16),
    "load_model_folder": load_model_folder,
    "read_model_folder_spec": read_model_folder_spec,
}
DAMAGE = {
    # name: (what the folder holds, words the error must say)
    "no folder": (None, "is not a folder"),
    "no config.json": ({}, "does not exist"),
    "config.json a directory": ({"config.json/": None}, "does not exist"),
    "not JSON": ({"config.json": b"{'model_type': 'llama'"}, "is not valid JSON"),
    "not UTF-8": ({"config.json": b'{"model_type": "\xff"}'}, "is not valid JSON"),
    "JSON list": ({"config.json": b"[1, 2]"}, "holds a JSON list"),
    "JSON string": ({"config.json": b'"llama"'}, "holds a JSON str"),
    "JSON null": ({"config.json": b"null"}, "holds a JSON NoneType"),
    "JSON number": ({"config.json": b"3"}, "holds a JSON int"),
}


def _damaged(tmp_path: Path, holds) -> Path:
    folder = tmp_path / "model"
    if holds is None:
        return folder
    folder.mkdir()
    for name, data in holds.items():
        if name.endswith("/"):
            (folder / name).mkdir()
        else:
            (folder / name).write_bytes(data)
    return folder


def _contents(folder: Path) -> dict[str, bytes | None]:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("loader", list(LOADERS))
def test_every_loader_names_a_damaged_folder_and_changes_nothing(loader, damage, tmp_path):
    holds, words = DAMAGE[damage]
    folder = _damaged(tmp_path, holds)
    before = _contents(folder)
    with pytest.raises(PrefillConfigError) as raised:
        LOADERS[loader](folder)
    message = str(raised.value)
    assert str(folder) in message and words in message, message
    assert not isinstance(raised.value, (OSError, json.JSONDecodeError, AttributeError, UnicodeError))
    error = raised.value
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__), (
        "a raw error behind it"
    )
    assert _contents(folder) == before


# -- folders transformers slides ---------------------------------------------------------------------------------

WINDOW = 8
FOLDERS = {
    # name: (family, overrides, the layer types transformers computes)
    "llama": ("llama", {}, ("full_attention",) * 2),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW), ("sliding_attention",) * 2),
    "qwen2-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        ("full_attention", "sliding_attention"),
    ),
    "qwen3-window": (
        "qwen3",
        dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
        ("sliding_attention", "full_attention"),
    ),
    "gemma3": ("gemma3", {}, gemma3_kit.TYPES),
}


def _folder(name: str, tmp_path: Path) -> Path:
    family, overrides, _ = FOLDERS[name]
    folder = tmp_path / name
    if family == "gemma3":
        hf = transformers.Gemma3ForCausalLM(gemma3_kit.text_config(WINDOW)).eval().float()
        gemma3_kit.randomize(hf, 5)
        hf.save_pretrained(folder)
    elif family == "llama":
        hf = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**family_kit.COMMON, vocab_size=199, tie_word_embeddings=False)
        ).eval()
        family_kit.randomize(hf, 5)
        hf.save_pretrained(folder)
    else:
        family_kit.family_checkpoint(family, folder, seed=5, **overrides)
    return folder


@pytest.mark.parametrize("name", [n for n in FOLDERS if n != "llama"])
def test_load_hf_folder_on_a_folder_transformers_slides_names_load_model_folder(name, tmp_path):
    folder = _folder(name, tmp_path)
    with pytest.raises(PrefillConfigError, match="load_model_folder") as raised:
        load_hf_folder(folder)
    assert str(folder / "config.json") in str(raised.value)


def _call(facade, model, prompt: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """One prefill of ``prompt`` as the plugin makes it: per-layer specs (or the legacy call), fresh blocks per
    KV group, ``page_tables_per_layer`` where there are several groups."""
    spec, bs = model.spec, 16
    shape = (num_blocks, spec.num_kv_heads, bs, spec.head_dim)
    width = -(-len(prompt) // bs)
    if isinstance(facade, HybridServingFacade):
        types = [g.kind.value for layer in range(spec.num_layers) for g in model.attention.groups if layer in g.layers]
        groups = vllm_layer_groups(types)
        index = {layer: i for group in groups for i, layer in enumerate(group)}
        kv = facade.allocate_kv_cache_per_layer([(shape, model.dtype, index[i]) for i in range(spec.num_layers)])
        tables = [torch.arange(1 + g * width, 1 + (g + 1) * width, dtype=torch.int32)[None] for g in range(len(groups))]
        of_layer = {layer: g for g, group in enumerate(groups) for layer in group}
        per_layer = [tables[of_layer[layer]].clone() for layer in range(spec.num_layers)]
        extra = {"page_tables_per_layer": per_layer} if len(groups) > 1 else {}
    else:
        kv = facade.allocate_kv_cache(shape, model.dtype, spec.num_layers)
        tables, extra = [torch.arange(1, 1 + width, dtype=torch.int32)[None]], {}
    logits = facade.prefill_forward(
        prompt[None],
        tables[0],
        prompt_lens=torch.tensor([len(prompt)]),
        start_pos=torch.tensor([0]),
        kv_cache=kv,
        enable_trace=False,
        **extra,
    )
    return logits[0, 0]


@pytest.mark.parametrize("name", list(FOLDERS))
def test_load_model_folder_serves_any_folder_as_transformers_computes_it(name, tmp_path):
    folder = _folder(name, tmp_path)
    model = load_model_folder(folder, block_size=16)
    types = FOLDERS[name][2]
    if "sliding_attention" in types:
        assert isinstance(model, HybridLlama)
        by_layer = {layer: g.kind.value for g in model.attention.groups for layer in g.layers}
        assert tuple(by_layer[i] for i in range(len(types))) == types
        assert all(g.window == (WINDOW if g.is_sliding else None) for g in model.attention.groups)
    else:
        assert isinstance(model, PagedLlama)
    policy = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1,), lane_size=1)
    facade = serving_facade(model, TorchBackend(), max_seq_len=128, max_batch_size=1, policy=policy)
    prompt = torch.randint(0, model.spec.vocab_size, (45,), generator=torch.Generator().manual_seed(2))
    logits = _call(facade, model, prompt, num_blocks=24)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0, -1]
    diff = float((logits - expected).abs().max())
    assert diff <= 1e-4 * max(1.0, float(expected.abs().max())), diff
    facade.cleanup()


@pytest.mark.parametrize("name", list(FOLDERS))
def test_read_model_folder_spec_is_the_architecture_load_model_folder_builds(name, tmp_path):
    """Without reading weights, the spec (and the dtype ``--dtype auto`` takes) of the model the folder loads as."""
    folder = _folder(name, tmp_path)
    spec = read_model_folder_spec(folder)
    model = load_model_folder(folder, block_size=16)
    assert spec.model_spec() == model.spec and spec.dtype == "float32"
