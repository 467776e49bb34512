"""One cattrs converter for every core value, and canonical JSON.

Canonical JSON (sorted keys, no spaces) is what identity keys digest, so a
key is a pure function of a value's fields.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeVar

import cattrs

__all__ = ["converter", "to_json", "from_json", "canonical_json", "digest"]

T = TypeVar("T")

converter = cattrs.Converter()


def canonical_json(value: Any) -> str:
    return json.dumps(converter.unstructure(value), sort_keys=True, separators=(",", ":"))


def to_json(value: Any, *, indent: int | None = None) -> str:
    return json.dumps(converter.unstructure(value), sort_keys=True, indent=indent)


def from_json(cls: type[T], text: str) -> T:
    return converter.structure(json.loads(text), cls)


def digest(value: Any, length: int = 16) -> str:
    """Short, stable hex digest of ``value``'s canonical JSON."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()[:length]
