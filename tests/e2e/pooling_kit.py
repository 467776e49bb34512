"""Random pooling checkpoints of each family, written by transformers and sentence-transformers themselves.

* ``write_tokenizer``: a word-level tokenizer (``w0`` .. ``w{n}``, ``yes``,
  ``no``, ``[PAD]``, ``[UNK]``) saved as transformers' fast tokenizer, so both
  sides tokenize text identically and prompts of any length are easy to make.
* ``causal_folder``: a randomized ``<Family>ForCausalLM`` (``family_kit``'s
  shapes; Llama at the same common shapes) with that tokenizer.
* ``st_folder``: sentence-transformers' own ``Transformer`` + ``Pooling``
  (+ ``Normalize``) over a causal folder, saved by ``SentenceTransformer.save``
  (what a user downloads); ``is_matryoshka`` set in its config.json as vLLM
  reads it.
* ``seq_cls_folder``: a randomized ``<Family>ForSequenceClassification`` with
  ``num_labels`` labels, saved by transformers.
* ``word_tokenizer``, ``sentence_transformer``, ``cross_encoder``: the folder's
  saved tokenizer and sentence-transformers' models over it, on every family
  (Qwen2 included: see ``OWN_TOKENIZER_CLASS``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.family_kit import COMMON, hf_config, randomize

WORDS = 180
PAD_ID = 0


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "yes": 2, "no": 3}
    vocab.update({f"w{i}": 4 + i for i in range(WORDS)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)


def word_tokenizer(folder: Path):
    """The tokenizer ``write_tokenizer`` saved in ``folder``, loaded as it is (transformers' ``TokenizersBackend``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


OWN_TOKENIZER_CLASS = ("qwen2",)
"""Families whose folders transformers 5 does not tokenize with the saved tokenizer: ``AutoTokenizer`` lists
``qwen2`` among the model types whose hub checkpoints name a wrong tokenizer class
(``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``), so it builds a ``Qwen2Tokenizer`` from the saved vocabulary, a
byte-level BPE without merges that encodes none of these words (Qwen3 maps to the same class but is not on that
list, so the saved class is kept). For these families both sides are handed ``word_tokenizer(folder)``, and only
the tokenizer is replaced: sentence-transformers, transformers and the runtime still read the model as saved."""


def folder_tokenizer(family: str, folder: Path):
    """The folder's tokenizer as a user's ``AutoTokenizer`` loads it, or the saved one where that differs."""
    if family in OWN_TOKENIZER_CLASS:
        return word_tokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def tokenizer_option(family: str, folder: Path) -> dict:
    """``PoolingRunner.from_folder``'s ``tokenizer=`` where the family needs it (``OWN_TOKENIZER_CLASS``), else
    nothing (the runner loads the folder's tokenizer with ``AutoTokenizer``, as a user's call does)."""
    return {"tokenizer": word_tokenizer(folder)} if family in OWN_TOKENIZER_CLASS else {}


def _with_word_tokenizer(model, family: str, folder: Path):
    if family in OWN_TOKENIZER_CLASS:
        model[0].processor = word_tokenizer(folder)  # a text model's Transformer module tokenizes with its processor
    return model


def sentence_transformer(family: str, folder: Path, **kwargs):
    """``SentenceTransformer(folder)`` tokenizing with the saved word-level tokenizer on every family."""
    from sentence_transformers import SentenceTransformer

    return _with_word_tokenizer(SentenceTransformer(str(folder), device="cpu", **kwargs), family, folder)


def cross_encoder(family: str, folder: Path):
    """``CrossEncoder(folder)`` tokenizing with the saved word-level tokenizer on every family."""
    from sentence_transformers import CrossEncoder

    return _with_word_tokenizer(CrossEncoder(str(folder), device="cpu"), family, folder)


def family_config(family: str, **overrides):
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(
            **{**COMMON, "vocab_size": 259, "tie_word_embeddings": False, "pad_token_id": PAD_ID, **overrides}
        )
    return hf_config(family, pad_token_id=PAD_ID, **overrides)


def _class(family: str, suffix: str):
    import transformers

    stem = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    return getattr(transformers, stem + suffix)


def causal_folder(family: str, folder: Path, seed: int = 0) -> Path:
    model = _class(family, "ForCausalLM")(family_config(family)).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def st_folder(family: str, folder: Path, mode: str, normalize: bool, seed: int = 0) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    body = causal_folder(family, folder.with_name(folder.name + "-body"), seed)
    transformer = Transformer(str(body), max_seq_length=COMMON["max_position_embeddings"])
    modules = [transformer, Pooling(COMMON["hidden_size"], pooling_mode=mode)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    if family in OWN_TOKENIZER_CLASS:  # it saved the tokenizer AutoTokenizer built, which encodes nothing here
        write_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    config["is_matryoshka"] = True
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def seq_cls_folder(family: str, folder: Path, num_labels: int, seed: int = 0) -> Path:
    model = _class(family, "ForSequenceClassification")(family_config(family, num_labels=num_labels)).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def texts(seed: int, lengths: list[int], shared: int = 0) -> list[str]:
    """Space-separated words of the given lengths; with ``shared``, every text starts with the same words."""
    rnd = random.Random(seed)
    head = [f"w{rnd.randrange(WORDS)}" for _ in range(shared)]
    return [" ".join(head + [f"w{rnd.randrange(WORDS)}" for _ in range(n - shared)]) for n in lengths]


ALL_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
