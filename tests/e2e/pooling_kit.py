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


# Qwen2 is left out: transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which rebuilds this word-level
# vocabulary into one that encodes nothing (the runtime's Qwen2 numerics are checked on token ids in test_families.py).
ALL_FAMILIES = ("llama", "qwen3", "mistral")
