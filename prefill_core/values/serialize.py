"""One cattrs converter for every core value, and canonical JSON.

Canonical JSON (sorted keys, no spaces) is what identity keys digest, so a
key is a pure function of a value's fields.

Structuring is strict: a JSON value of the wrong type (``"false"`` for a
bool, ``2048.5`` or ``true`` for an int) or a key that names no field is
refused, never coerced or dropped, so a hand-edited policy file cannot load
as a different policy than it reads.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeVar

import cattrs

from prefill_core.values.errors import InvalidJSONError, PrefillInputError

__all__ = ["converter", "to_json", "from_json", "canonical_json", "digest"]

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=True)


def _exact(kind: type):
    def structure(value: object, _: type) -> object:
        if type(value) is not kind:
            raise TypeError(f"{value!r} is not a JSON {kind.__name__}")
        return value

    return structure


def _real(value: object, _: type) -> object:
    """A JSON number for a float field, kept as read (an int stays an int: equal, and exact)."""
    if type(value) not in (int, float):
        raise TypeError(f"{value!r} is not a JSON number")
    return value


for _kind in (int, bool, str):
    converter.register_structure_hook(_kind, _exact(_kind))
converter.register_structure_hook(float, _real)


def canonical_json(value: Any) -> str:
    return json.dumps(converter.unstructure(value), sort_keys=True, separators=(",", ":"))


def to_json(value: Any, *, indent: int | None = None) -> str:
    return json.dumps(converter.unstructure(value), sort_keys=True, indent=indent)


def from_json(cls: type[T], text: str) -> T:
    """The ``cls`` value ``text`` holds.

    Raises ``InvalidJSONError`` naming each bad path, or the value's own named error when its constructor refuses it.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidJSONError(f"{getattr(cls, '__name__', cls)} JSON is invalid: {error}", field="json") from None
    try:
        return converter.structure(data, cls)
    except cattrs.BaseValidationError as error:
        own = _own_error(error)
        if own is not None:  # the value's constructor refused it: its named error says why
            raise own from None
        problems = "; ".join(cattrs.transform_error(error, path=getattr(cls, "__name__", "value")))
        raise InvalidJSONError(f"JSON is invalid: {problems}", field="json") from None


def _own_error(group: BaseException) -> PrefillInputError | None:
    """The first ``PrefillInputError`` a value's constructor raised inside cattrs' error group, if any."""
    for error in getattr(group, "exceptions", ()):
        found = error if isinstance(error, PrefillInputError) else _own_error(error)
        if found is not None:
            return found
    return None


def digest(value: Any, length: int = 16) -> str:
    """Short, stable hex digest of ``value``'s canonical JSON."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()[:length]
