"""Pooling model folders: sentence-transformers folders and transformers' ``*ForSequenceClassification``.

``load_pooling_folder`` reads one folder into a ``PoolingFolder``: the
reference model of its body (``PagedLlama``), the pooler settings
(``prefill_core.values.pooling.PoolerConfig``) as sentence-transformers and vLLM
read them, and the classification head's weight where there is one. Three
shapes, told apart by what the folder holds:

* **sentence-transformers** (``modules.json``): a Transformer module at the
  folder's root, a Pooling module (``1_Pooling/config.json``: ``pooling_mode``
  or the legacy ``pooling_mode_*_tokens`` flags, as sentence-transformers
  6.x converts them), and an optional Normalize module, which makes
  ``normalize`` the default (vLLM reads the same folder this way:
  ``vllm/transformers_utils/config.py`` ``get_pooling_config``). The
  Transformer's checkpoint may be a bare ``*Model`` (tensor names without
  ``model.``) or a ``*ForCausalLM``. ``sentence_bert_config.json`` gives
  ``max_seq_length`` (sentence-transformers truncates inputs to it).
* **sequence classification** (``architectures``
  ``[<Family>ForSequenceClassification]``): the body and ``score.weight``
  ``[num_labels, hidden]``; pooling is LAST (transformers takes the last
  non-pad token); ``num_labels`` from ``id2label`` (transformers' default 2
  where absent), the activation from ``problem_type`` and ``num_labels`` by
  vLLM's rule.
* **causal LM** (``<Family>ForCausalLM``): LAST pooling, no head; the
  runner's reranker recipe reads its LM head (Qwen3-Reranker).

Matryoshka support is read as vLLM reads it from ``config.json``
(``is_matryoshka``, ``matryoshka_dimensions``). Anything a loader would
compute differently is refused by name with a ``PrefillConfigError``: a
module other than Transformer/Pooling/Normalize (Dense, LayerNorm, ...),
pooling modes other than cls/mean/lasttoken or several at once,
``include_prompt: false``, lower-casing, a default prompt, a window that
slides (pooling runs on full-attention bodies), a head with a bias or of
the wrong shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch

from prefill_core.values.errors import PrefillConfigError
from prefill_core.values.pooling import PoolerConfig, PoolingType, classify_activation
from prefill_shell.reference.llama_like.config import FAMILIES, LlamaSpec, in_folder, needs_hybrid, read_config_dict
from prefill_shell.reference.llama_like.llama import PagedLlama
from prefill_shell.reference.loading.weights import _read_shard, _shard_files

__all__ = ["PoolingFolder", "is_pooling_folder", "load_pooling_folder"]

_ST_POOLING_MODES = {"lasttoken": PoolingType.LAST, "mean": PoolingType.MEAN, "cls": PoolingType.CLS}
_ST_LEGACY_FLAGS = {  # sentence-transformers' legacy flag -> mode, in its concatenation order
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@attrs.frozen(eq=False)
class PoolingFolder:
    """A loaded pooling model: the body, its pooler, and the head where the folder has one.

    ``kind``: ``"sentence-transformers"``, ``"sequence-classification"`` or
    ``"causal-lm"``. ``score``: the head ``[num_labels, hidden]`` (float32,
    on the model's device) or None. ``max_seq_length``: the input
    truncation sentence-transformers applies (None: the model's limit).
    """

    folder: Path
    kind: str
    model: PagedLlama
    pooler: PoolerConfig
    score: torch.Tensor | None = None
    max_seq_length: int | None = None


def _architecture(cfg: dict[str, Any]) -> str | None:
    names = cfg.get("architectures") or []
    return names[0] if isinstance(names, list) and names else None


def is_pooling_folder(folder: str | Path) -> bool:
    """Whether ``folder`` is a sentence-transformers or a sequence-classification folder."""
    folder = Path(folder)
    if (folder / "modules.json").is_file():
        return True
    if not (folder / "config.json").is_file():
        return False
    arch = _architecture(read_config_dict(folder))
    return bool(arch) and (arch.endswith("ForSequenceClassification") or arch.endswith("Model"))


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise PrefillConfigError(f"{path} does not exist: {what}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PrefillConfigError(f"{path} is not valid JSON ({error})") from None


def _st_pooling(folder: Path, path: str, hidden: int) -> PoolingType:
    cfg_path = folder / path / "config.json"
    cfg = _read_json(cfg_path, "a sentence-transformers Pooling module keeps its settings there")
    if not isinstance(cfg, dict):
        raise PrefillConfigError(f"{cfg_path} holds a JSON {type(cfg).__name__}, expected an object")
    mode = cfg.get("pooling_mode")
    if mode is None:  # sentence-transformers' legacy flags (its _convert_legacy_pooling_kwargs: none set is mean)
        modes = [m for flag, m in _ST_LEGACY_FLAGS.items() if cfg.get(flag)] or ["mean"]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1:
        raise PrefillConfigError(f"{cfg_path} pooling_mode={modes!r} is unsupported: one mode (concatenated modes)")
    if modes[0] not in _ST_POOLING_MODES:
        raise PrefillConfigError(
            f"{cfg_path} pooling_mode={modes[0]!r} is unsupported: the runtime pools {sorted(_ST_POOLING_MODES)}"
        )
    if cfg.get("include_prompt", True) is not True:
        raise PrefillConfigError(
            f"{cfg_path} include_prompt={cfg['include_prompt']!r} is unsupported: every position of the input is pooled"
        )
    width = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension", hidden))
    if width != hidden:
        raise PrefillConfigError(
            f"{cfg_path} embedding_dimension={width!r} is invalid: the model's hidden_size is {hidden}"
        )
    return _ST_POOLING_MODES[modes[0]]


def _st_modules(folder: Path, hidden: int) -> tuple[PoolingType, bool, int | None]:
    """(pooling type, has Normalize, max_seq_length) of a sentence-transformers folder."""
    path = folder / "modules.json"
    modules = _read_json(path, "a sentence-transformers folder lists its modules there")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise PrefillConfigError(f"{path} is not a list of module objects")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    for module, kind in zip(modules, kinds):
        if kind not in _ST_MODULES:
            raise PrefillConfigError(
                f"{path} module {module.get('type')!r} is unsupported: the runtime computes {list(_ST_MODULES)}"
            )
    if kinds[:2] != ["Transformer", "Pooling"] or kinds[2:] not in ([], ["Normalize"]):
        raise PrefillConfigError(
            f"{path} modules {kinds} are unsupported: Transformer, Pooling, then Normalize or none"
        )
    if modules[0].get("path", "") not in ("", "."):
        raise PrefillConfigError(
            f"{path} Transformer path={modules[0].get('path')!r} is unsupported: the transformer sits at the root"
        )
    pooling = _st_pooling(folder, modules[1].get("path", ""), hidden)
    max_len = None
    bert = folder / "sentence_bert_config.json"
    if bert.is_file():
        settings = _read_json(bert, "")
        if settings.get("do_lower_case"):
            raise PrefillConfigError(f"{bert} do_lower_case=True is unsupported: inputs are tokenized as given")
        max_len = settings.get("max_seq_length")
    st_config = folder / "config_sentence_transformers.json"
    if st_config.is_file():
        settings = _read_json(st_config, "")
        if settings.get("default_prompt_name"):
            raise PrefillConfigError(
                f"{st_config} default_prompt_name={settings['default_prompt_name']!r} is unsupported: "
                "put the prompt in the text"
            )
    return pooling, len(kinds) == 3, max_len


def _body_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in _shard_files(folder):
        weights.update(_read_shard(shard))
    if "model.embed_tokens.weight" not in weights:  # a bare *Model (sentence-transformers saves one): no "model."
        weights = {name if name.startswith("lm_head.") else f"model.{name}": t for name, t in weights.items()}
    return weights


def load_pooling_folder(
    folder: str | Path, *, device: torch.device | str = "cpu", dtype: str | None = None
) -> PoolingFolder:
    """The folder's body, pooler and head; every defect a ``PrefillConfigError`` naming the path and key."""
    folder = Path(folder)
    cfg = read_config_dict(folder)
    arch = _architecture(cfg) or ""
    model_type = cfg.get("model_type") or "llama"
    family = FAMILIES.get(model_type)
    if family is None:
        raise in_folder(
            folder,
            PrefillConfigError(f"config.json model_type={model_type!r} is unsupported for pooling: {sorted(FAMILIES)}"),
        )
    stem = family.architecture.removesuffix("ForCausalLM")
    st_folder = (folder / "modules.json").is_file()
    known = {f"{stem}Model": "model", f"{stem}ForSequenceClassification": "classify", family.architecture: "causal"}
    if arch and arch not in known:
        rule = f"model_type={model_type!r} pools from {sorted(known)}"
        raise in_folder(folder, PrefillConfigError(f"config.json architectures entry {arch!r} is unsupported: {rule}"))
    shape = known.get(arch, "causal")
    body_cfg = {**cfg, "architectures": [family.architecture]}
    try:
        if needs_hybrid(body_cfg):
            raise PrefillConfigError(
                "config.json sliding_window is unsupported for pooling: the pooled body attends every position fully"
            )
        if shape != "causal":
            body_cfg["tie_word_embeddings"] = (
                True  # no LM head stored: the runtime's last-token logits read the embeddings
            )
        spec = LlamaSpec.from_hf_dict(body_cfg)
    except PrefillConfigError as error:
        raise in_folder(folder, error) from None
    if dtype is not None:
        spec = attrs.evolve(spec, dtype=dtype)
    weights = _body_weights(folder)
    score = weights.pop("score.weight", None)
    if "score.bias" in weights:
        raise PrefillConfigError(
            f"{folder}: checkpoint tensor 'score.bias' is unsupported: transformers' head has none"
        )
    if shape == "causal" and not spec.tie_word_embeddings and "lm_head.weight" not in weights:
        raise PrefillConfigError(f"{folder}: checkpoint lacks lm_head.weight (config.json ties no head)")
    if shape != "causal":
        weights.pop("lm_head.weight", None)
    if spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    model = PagedLlama(spec, weights, device=device)
    hidden = spec.hidden_size
    matryoshka_dims = cfg.get("matryoshka_dimensions")
    matryoshka = bool(cfg.get("is_matryoshka")) or matryoshka_dims is not None
    common = dict(
        hidden_size=hidden,
        matryoshka=matryoshka,
        matryoshka_dimensions=None if matryoshka_dims is None else tuple(matryoshka_dims),
    )
    if st_folder:
        pooling, normalize, max_len = _st_modules(folder, hidden)
        pooler = PoolerConfig(pooling_type=pooling, normalize=normalize, **common)
        return PoolingFolder(folder, "sentence-transformers", model, pooler, None, max_len)
    if shape == "classify":
        labels = cfg.get("id2label")
        num_labels = len(labels) if isinstance(labels, dict) and labels else cfg.get("num_labels", 2)
        if score is None or tuple(score.shape) != (num_labels, hidden):
            got = None if score is None else tuple(score.shape)
            raise PrefillConfigError(f"{folder}: score.weight has shape {got}, expected {(num_labels, hidden)}")
        try:
            activation = classify_activation(num_labels, cfg.get("problem_type"))
        except PrefillConfigError as error:
            raise in_folder(folder, PrefillConfigError(f"config.json {error}")) from None
        pooler = PoolerConfig(num_labels=num_labels, activation=activation, **common)
        head = score.to(device=model.device, dtype=torch.float32)
        return PoolingFolder(folder, "sequence-classification", model, pooler, head)
    if score is not None:
        raise PrefillConfigError(
            f"{folder}: checkpoint tensor 'score.weight' is unsupported for {arch or 'this'} folder"
        )
    return PoolingFolder(folder, "causal-lm" if shape == "causal" else "model", model, PoolerConfig(**common))
