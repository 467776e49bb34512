"""Text in, text out: what ``--model`` names (weights and tokenizer), prompts from files, tokens as text.

``--model`` is a ``.gguf`` file (weights and tokenizer both come from it),
a Hugging Face folder (``config.json`` + safetensors, tokenizer files if
present), ``random:NAME`` for a seeded preset of ``reference.weights``
(token ids only), or nothing: the pinned SmolLM2 file. transformers builds
the tokenizers; it is imported only when one is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch

from prefill_core.errors import PrefillConfigError

from .reference import PRESETS, PagedLlama, load_gguf, load_hf_folder, random_llama
from .reference.smollm2 import smollm2_path

__all__ = [
    "RANDOM_PREFIX",
    "Prompt",
    "PromptError",
    "encode",
    "load_model",
    "load_tokenizer",
    "read_prompt_file",
    "read_token_id_file",
    "token_text",
]

RANDOM_PREFIX = "random:"


class PromptError(ValueError):
    """A prompt or prompt file cannot be turned into token ids; the message names the file and line."""


@attrs.frozen
class Prompt:
    """One prompt: plain ``text``, or chat ``messages`` (``{"role", "content"}`` dicts)."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


def model_path(ref: str | None) -> Path:
    """The file or folder ``--model`` names (the pinned SmolLM2 file when ``ref`` is None)."""
    return smollm2_path() if ref is None else Path(ref)


def load_model(ref: str | None, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PagedLlama:
    """The weights ``--model`` names, as a ``PagedLlama``."""
    if ref is not None and ref.startswith(RANDOM_PREFIX):
        name = ref[len(RANDOM_PREFIX) :]
        if name not in PRESETS:
            raise PrefillConfigError(f"--model {ref!r} is invalid: presets are {sorted(PRESETS)}")
        return random_llama(0, name, device=device)
    path = model_path(ref)
    if path.suffix == ".gguf":
        return load_gguf(path, dtype=dtype, device=device)
    if path.is_dir():
        return load_hf_folder(path, device=device, dtype=str(dtype).removeprefix("torch."))
    raise PrefillConfigError(
        f"--model {str(path)!r} is invalid: expected a .gguf file, a Hugging Face folder or random:NAME"
    )


def load_tokenizer(ref: str | None) -> Any:
    """The tokenizer that belongs to ``--model``, or None (random presets; a folder without tokenizer files)."""
    if ref is not None and ref.startswith(RANDOM_PREFIX):
        return None
    path = model_path(ref)
    if path.is_dir() and not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        # transformers rebuilds the tokenizer from the file's tokenizer.ggml.* metadata.
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """Prompts from a file: one per non-empty line, or in a ``.jsonl`` file one JSON object per line
    holding ``prompt`` (text) or ``messages`` (a chat)."""
    path = Path(path)
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    if path.suffix != ".jsonl":
        return [Prompt(text=line) for _, line in lines]
    return [_json_prompt(path, n, line) for n, line in lines]


def _json_prompt(path: Path, number: int, line: str) -> Prompt:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise PromptError(f"{where}: not a JSON object ({error.msg})") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return Prompt(text=record["prompt"])
    messages = record.get("messages") if isinstance(record, dict) else None
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return Prompt(messages=tuple({"role": m["role"], "content": m["content"]} for m in messages))
    raise PromptError(
        f"{where}: expected an object with a 'prompt' string or a non-empty 'messages' list of {{role, content}}"
    )


def read_token_id_file(path: str | Path) -> list[list[int]]:
    """Prompts as token ids, one prompt of space-separated ids per non-empty line."""
    out = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append([int(part) for part in line.split()])
        except ValueError:
            raise PromptError(
                f"{path}:{number}: expected space-separated token ids, got {line.strip()[:40]!r}"
            ) from None
    return out


def encode(tokenizer: Any, prompt: Prompt, chat: bool) -> list[int]:
    """Token ids of ``prompt``; messages (or any prompt when ``chat``) go through the model's chat template."""
    if tokenizer is None:
        raise PromptError("text prompts need a tokenizer: this model has none (pass --token-ids FILE)")
    messages = prompt.messages
    if messages is None and chat:
        messages = ({"role": "user", "content": prompt.text},)
    if messages is None:
        return list(tokenizer(prompt.text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("chat prompts need a chat template: this model's tokenizer has none")
    # Render to text first, then tokenize without adding special tokens: the
    # template already holds every one it wants.
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_text(tokenizer: Any, token: int) -> str:
    """One token as quoted text (``' Paris'``), or ``#id`` without a tokenizer."""
    if tokenizer is None:
        return f"#{token}"
    return repr(tokenizer.decode([token]))
