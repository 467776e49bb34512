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

from prefill_core.values.dtype import AUTO, DtypeChoice, canonical_dtype
from prefill_core.values.errors import PrefillConfigError
from prefill_shell.backends.numerics import choose_dtype
from prefill_shell.extras import requires_extra
from prefill_shell.reference import PRESETS, PagedLlama, load_gguf, load_hf_folder, random_llama
from prefill_shell.reference.loading.gguf import gguf_has_tokenizer
from prefill_shell.reference.loading.model_folder import load_model_folder, read_model_folder_spec
from prefill_shell.reference.loading.smollm2 import smollm2_path
from prefill_shell.reference.windows.hybrid import HybridLlama

__all__ = [
    "RANDOM_PREFIX",
    "Prompt",
    "PromptError",
    "checkpoint_dtype",
    "encode",
    "load_model",
    "model_dtype",
    "load_tokenizer",
    "read_prompt_file",
    "read_text_lines",
    "read_token_id_file",
    "read_token_id_lines",
    "token_text",
]

RANDOM_PREFIX = "random:"
_GGUF_MAGIC = b"GGUF"
_JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")


class PromptError(ValueError):
    """A prompt or prompt file cannot be turned into token ids; the message names the file and line."""


@attrs.frozen
class Prompt:
    """One prompt: plain ``text``, or chat ``messages`` (``{"role", "content"}`` dicts)."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    source: str = ""  # where it came from, for messages: ``FILE:LINE`` or ``--prompt #N``


def model_path(ref: str | None) -> Path:
    """The file or folder ``--model`` names (the pinned SmolLM2 file when ``ref`` is None)."""
    return smollm2_path() if ref is None else Path(ref)


def _is_gguf(path: Path) -> bool:
    """A file is GGUF by its magic bytes, or by a ``.gguf`` suffix in any case (damaged files are then named)."""
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as fh:
        return fh.read(4) == _GGUF_MAGIC


def checkpoint_dtype(ref: str | None) -> str | None:
    """The dtype ``--model``'s checkpoint stores, for ``dtype=auto``: a folder's ``config.json`` names one (float32
    where it is silent); a GGUF file (quantized) and a random preset name none."""
    if ref is not None and ref.startswith(RANDOM_PREFIX):
        return None
    path = model_path(ref)
    return read_model_folder_spec(path).dtype if _model_kind(path) == "folder" else None


def model_dtype(ref: str | None, request: str | torch.dtype = "float32", device: str = "cpu") -> DtypeChoice:
    """The dtype a model named by ``ref`` runs in for ``request`` (``prefill_core.values.dtype``'s rules) and why."""
    request = str(request).removeprefix("torch.")
    return choose_dtype(request, checkpoint_dtype(ref) if canonical_dtype(request) == AUTO else None, device)


def load_model(
    ref: str | None,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    block_size: int | None = None,
) -> PagedLlama | HybridLlama:
    """The weights ``--model`` names in ``dtype`` (a name, ``auto`` or ``native``), as a ``PagedLlama``.

    With ``block_size`` (a caller that runs KV groups), a folder transformers
    slides (Gemma 3, a windowed Mistral, Qwen2 or Qwen3) loads as the
    ``HybridLlama`` whose groups take ``block_size``-token blocks
    (``load_model_folder``); without it such a folder is the plain loader's
    ``PrefillConfigError`` naming ``load_model_folder``.
    """
    name = model_dtype(ref, dtype, device).dtype
    if ref is not None and ref.startswith(RANDOM_PREFIX):
        preset = ref[len(RANDOM_PREFIX) :]
        if preset not in PRESETS:
            raise PrefillConfigError(f"--model {ref!r} is invalid: presets are {sorted(PRESETS)}")
        return random_llama(0, preset, device=device, dtype=name)
    path = model_path(ref)
    if _model_kind(path) == "folder":
        if block_size is None:
            return load_hf_folder(path, device=device, dtype=name)
        return load_model_folder(path, device=device, dtype=name, block_size=block_size)
    return load_gguf(path, dtype=getattr(torch, name), device=device)


def _model_kind(path: Path) -> str:
    """``"folder"`` (Hugging Face) or ``"gguf"``; anything else is a named error."""
    if path.is_dir():
        return "folder"
    if not path.exists():
        raise PrefillConfigError(f"--model {str(path)!r}: no such file or folder")
    if path.is_file() and _is_gguf(path):
        return "gguf"
    raise PrefillConfigError(
        f"--model {str(path)!r} is invalid: expected a GGUF file, a Hugging Face folder or random:NAME"
    )


def load_tokenizer(ref: str | None) -> Any:
    """The tokenizer that belongs to ``--model``, or None (random presets; a folder without tokenizer
    files; a GGUF file without ``tokenizer.ggml`` metadata)."""
    if ref is not None and ref.startswith(RANDOM_PREFIX):
        return None
    path = model_path(ref)
    gguf = _model_kind(path) == "gguf"
    if not gguf:
        read_model_folder_spec(path)  # a bad config.json is named as such, not as a tokenizer failure
    if not gguf and not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    if gguf and not gguf_has_tokenizer(path):
        return None
    with requires_extra("text", "a tokenizer"):
        from transformers import AutoTokenizer

    try:
        if gguf:
            # transformers rebuilds the tokenizer from the file's tokenizer.ggml.* metadata.
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as error:  # transformers raises many types for a tokenizer it cannot build
        raise PrefillConfigError(
            f"--model {str(path)!r}: its tokenizer cannot be built ({type(error).__name__}: {_first_line(error)}); "
            "pass token ids with --token-ids FILE instead"
        ) from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def read_text_lines(path: str | Path, flag: str) -> list[tuple[int, str]]:
    """The non-blank lines of a UTF-8 file (a byte-order mark dropped) with their line numbers.

    Raises ``PromptError`` naming ``flag`` and the file when it cannot be read,
    is not UTF-8 text or holds no non-blank line.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise PromptError(f"{flag} {path}: not UTF-8 text (byte {error.start}): save it as UTF-8") from None
    except OSError as error:
        raise PromptError(f"{flag} {path}: cannot be read ({error.strerror or error}): check the path") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise PromptError(f"{flag} {path}: holds no prompts (the file is empty or blank): put one prompt per line")
    return lines


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """Prompts from a file: one per non-empty line, or JSON lines (one object per line holding
    ``prompt`` (text) or ``messages`` (a chat)).

    A file is JSON lines when its suffix is ``.jsonl`` or ``.ndjson`` in any
    case, or when its first non-blank line is a JSON object with a ``prompt``
    or ``messages`` key. Each prompt's ``source`` is ``FILE:LINE``.
    """
    path = Path(path)
    lines = read_text_lines(path, "--prompts")
    if not _is_json_lines(path, lines[0][1]):
        return [Prompt(text=line, source=f"{path}:{n}") for n, line in lines]
    return [_json_prompt(path, n, line) for n, line in lines]


def _is_json_lines(path: Path, first: str) -> bool:
    if path.suffix.lower() in _JSON_LINES_SUFFIXES:
        return True
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and ("prompt" in record or "messages" in record)


def _json_prompt(path: Path, number: int, line: str) -> Prompt:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise PromptError(f"{where}: not a JSON object ({error.msg})") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return Prompt(text=record["prompt"], source=where)
    messages = record.get("messages") if isinstance(record, dict) else None
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return Prompt(messages=tuple({"role": m["role"], "content": m["content"]} for m in messages), source=where)
    raise PromptError(
        f"{where}: expected an object with a 'prompt' string or a non-empty 'messages' list of {{role, content}}"
    )


def read_token_id_file(path: str | Path) -> list[list[int]]:
    """Prompts as token ids, one prompt of space-separated ids per non-empty line."""
    return [ids for _, ids in read_token_id_lines(path)]


def read_token_id_lines(path: str | Path) -> list[tuple[str, list[int]]]:
    """``(FILE:LINE, ids)`` per non-empty line of space-separated non-negative token ids."""
    out = []
    for number, line in read_text_lines(path, "--token-ids"):
        try:
            ids = [int(part) for part in line.split()]
        except ValueError:
            ids = [-1]
        if min(ids) < 0:
            raise PromptError(
                f"--token-ids {path}:{number}: expected space-separated non-negative token ids, "
                f"got {line.strip()[:40]!r}"
            )
        out.append((f"{path}:{number}", ids))
    return out


def encode(tokenizer: Any, prompt: Prompt, chat: bool) -> list[int]:
    """Token ids of ``prompt``; messages (or any prompt when ``chat``) go through the model's chat template."""
    named = f"prompt {prompt.source}: " if prompt.source else ""
    if tokenizer is None:
        raise PromptError(f"{named}text prompts need a tokenizer: this model has none (pass --token-ids FILE)")
    messages = prompt.messages
    if messages is None and chat:
        messages = ({"role": "user", "content": prompt.text},)
    if messages is None:
        return list(tokenizer(prompt.text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"{named}chat prompts need a chat template: this model's tokenizer has none")
    # Render to text first, then tokenize without adding special tokens: the
    # template already holds every one it wants.
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_text(tokenizer: Any, token: int) -> str:
    """One token as quoted text (``' Paris'``), or ``#id`` without a tokenizer."""
    if tokenizer is None:
        return f"#{token}"
    return repr(tokenizer.decode([token]))
