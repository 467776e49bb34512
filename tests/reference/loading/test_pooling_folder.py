"""prefill_shell.reference.loading.pooling_folder: sentence-transformers and sequence-classification folders, their
settings read as sentence-transformers 6.3 and vLLM read them, and every unsupported one refused by name.
(The numbers against sentence-transformers and transformers themselves: tests/e2e/test_pooling.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefill_core.values.errors import PrefillConfigError
from prefill_core.values.pooling import ClassifyActivation, PoolingType
from prefill_shell.reference import random_llama
from prefill_shell.reference.llama_like.llama import PagedLlama
from prefill_shell.reference.loading.model_folder import load_model_folder
from prefill_shell.reference.loading.pooling_folder import load_pooling_folder
from prefill_shell.reference.loading.weights import save_hf_folder

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def _st(tmp_path, pooling: dict, modules=(TRANSFORMER, POOLING, NORMALIZE), **files):
    folder = save_hf_folder(random_llama(0, "tiny"), tmp_path / "st")
    (folder / "modules.json").write_text(json.dumps(list(modules)))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content))
    return folder


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [
        ({"embedding_dimension": 64, "pooling_mode": "lasttoken"}, PoolingType.LAST),
        ({"embedding_dimension": 64, "pooling_mode": ["mean"]}, PoolingType.MEAN),
        ({"word_embedding_dimension": 64, "pooling_mode_cls_token": True}, PoolingType.CLS),
        (
            {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False},
            PoolingType.LAST,
        ),
        ({"word_embedding_dimension": 64}, PoolingType.MEAN),  # no flag set: sentence-transformers' default
    ],
)
def test_sentence_transformers_pooling_settings_are_read_as_it_reads_them(tmp_path, pooling, expected):
    loaded = load_pooling_folder(_st(tmp_path, pooling, **{"sentence_bert_config.json": {"max_seq_length": 77}}))
    assert (loaded.kind, loaded.pooler.pooling_type, loaded.pooler.normalize) == (
        "sentence-transformers",
        expected,
        True,
    )
    assert loaded.max_seq_length == 77 and loaded.score is None
    no_norm = _st(tmp_path / "b", pooling, modules=(TRANSFORMER, POOLING))
    assert load_pooling_folder(no_norm).pooler.normalize is False
    assert isinstance(load_model_folder(no_norm), PagedLlama)  # the one loader serves the folder's body


@pytest.mark.parametrize(
    ("pooling", "modules", "files", "named"),
    [
        ({"pooling_mode": "max"}, None, {}, "pooling_mode='max' is unsupported"),
        ({"pooling_mode": ["mean", "cls"]}, None, {}, "one mode"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, None, {}, "one mode"),
        ({"pooling_mode": "mean", "include_prompt": False}, None, {}, "include_prompt=False"),
        ({"pooling_mode": "mean", "embedding_dimension": 32}, None, {}, "embedding_dimension=32"),
        (
            {"pooling_mode": "mean"},
            (TRANSFORMER, POOLING, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}),
            {},
            "module 'sentence_transformers.models.Dense' is unsupported",
        ),
        ({"pooling_mode": "mean"}, (POOLING, TRANSFORMER), {}, "Transformer, Pooling, then Normalize"),
        ({"pooling_mode": "mean"}, ({**TRANSFORMER, "path": "0_Transformer"}, POOLING), {}, "path='0_Transformer'"),
        ({"pooling_mode": "mean"}, None, {"sentence_bert_config.json": {"do_lower_case": True}}, "do_lower_case"),
        (
            {"pooling_mode": "mean"},
            None,
            {"config_sentence_transformers.json": {"default_prompt_name": "query"}},
            "default_prompt_name='query'",
        ),
    ],
)
def test_unsupported_sentence_transformers_settings_are_refused_by_name(tmp_path, pooling, modules, files, named):
    folder = _st(tmp_path, pooling, **({} if modules is None else {"modules": modules}))
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content))
    with pytest.raises(PrefillConfigError, match=named):
        load_pooling_folder(folder)


def _seq_cls(tmp_path, labels: int, **config):
    folder = save_hf_folder(random_llama(0, "tiny", tie_word_embeddings=True), tmp_path / "cls")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["LlamaForSequenceClassification"], **config)
    if labels != 2:
        cfg["id2label"] = {str(i): f"L{i}" for i in range(labels)}
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(folder / "model.safetensors")
    weights["score.weight"] = torch.randn(labels, 64)
    save_file(weights, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize(
    ("labels", "problem_type", "activation"),
    [
        (1, None, ClassifyActivation.SIGMOID),
        (2, None, ClassifyActivation.SOFTMAX),
        (4, "multi_label_classification", ClassifyActivation.SIGMOID),
        (1, "regression", ClassifyActivation.IDENTITY),
    ],
)
def test_a_sequence_classification_folder_brings_its_head(tmp_path, labels, problem_type, activation):
    extra = {} if problem_type is None else {"problem_type": problem_type}
    loaded = load_pooling_folder(_seq_cls(tmp_path, labels, **extra))
    assert loaded.kind == "sequence-classification" and loaded.pooler.pooling_type is PoolingType.LAST
    assert (loaded.pooler.num_labels, loaded.pooler.activation) == (labels, activation)
    assert loaded.score.shape == (labels, 64)


def test_sequence_classification_defects_are_refused_by_name(tmp_path):
    folder = _seq_cls(tmp_path, 3, problem_type="ranking")
    with pytest.raises(PrefillConfigError, match="problem_type='ranking'"):
        load_pooling_folder(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(problem_type=None, id2label={"0": "a", "1": "b"})
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PrefillConfigError, match=r"score.weight has shape \(3, 64\), expected \(2, 64\)"):
        load_pooling_folder(folder)
    cfg.update(architectures=["LlamaForTokenClassification"])
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PrefillConfigError, match="'LlamaForTokenClassification' is unsupported"):
        load_pooling_folder(folder)
    cfg.update(architectures=["MistralForSequenceClassification"], model_type="mistral", sliding_window=16)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PrefillConfigError, match="sliding_window is unsupported for pooling"):
        load_pooling_folder(folder)


def test_matryoshka_support_is_read_from_config_as_vllm_reads_it(tmp_path):
    folder = _st(tmp_path, {"pooling_mode": "lasttoken"})
    assert load_pooling_folder(folder).pooler.matryoshka is False
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    pooler = load_pooling_folder(folder).pooler
    assert pooler.matryoshka and pooler.matryoshka_dimensions == (16, 32)
