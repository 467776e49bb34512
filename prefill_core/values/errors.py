"""The error hierarchy shared by the core and the shell.

Every error a caller can provoke is a ``PrefillError``. Input errors also
subclass ``ValueError`` so code that already catches ``ValueError`` keeps
working. Messages are built before the raise and name the row (when there is
one), the field, the value and the rule that was broken.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "PrefillError",
    "PrefillInputError",
    "EmptyBatchError",
    "InvalidLengthError",
    "InvalidCachedLengthError",
    "InvalidSlotError",
    "InvalidPageTableError",
    "WindowTableError",
    "BlockConflictError",
    "RepeatedBlockError",
    "SharedBlockColumnError",
    "BlockDependencyCycleError",
    "CapacityError",
    "PositionLimitError",
    "InvalidSamplingError",
    "KVCacheMismatchError",
    "InvalidScoringRequestError",
    "InvalidPolicyError",
    "InvalidLayoutError",
    "InvalidJSONError",
    "TraceBudgetError",
    "PrefillConfigError",
    "InvalidDtypeError",
    "TraceCoverageError",
    "PrefillStateError",
    "CleanupError",
]


class PrefillError(Exception):
    """Root of every error this library raises on purpose."""


class ArgumentError(ValueError):
    """A command-line argument (or a histogram file's line) is malformed; the message is one line naming it."""


class PrefillInputError(PrefillError, ValueError):
    """The caller's input breaks a rule; nothing was changed.

    ``row`` is the caller's row index (``None`` for batch- or policy-level
    rules) and ``field`` the offending field's name.
    """

    def __init__(self, message: str, *, row: int | None = None, field: str | None = None):
        super().__init__(message)
        self.row = row
        self.field = field


def row_error(cls: type[PrefillInputError], row: int, field: str, value: object, rule: str) -> PrefillInputError:
    """Builds ``cls`` with the one message shape every row error uses."""
    msg = f"row {row}: {field}={value!r} is invalid: {rule}"
    return cls(msg, row=row, field=field)


def field_error(cls: type[PrefillInputError], owner: str, field: str, value: object, rule: str) -> PrefillInputError:
    """Builds ``cls`` for a field of a non-row value (policy, layout, batch)."""
    msg = f"{owner}.{field}={value!r} is invalid: {rule}"
    return cls(msg, field=field)


class EmptyBatchError(PrefillInputError):
    """The batch has no rows."""


class InvalidLengthError(PrefillInputError):
    """A prompt length is not a positive integer."""


class InvalidCachedLengthError(PrefillInputError):
    """A cached-prefix length is negative or beyond the prompt."""


class InvalidSlotError(PrefillInputError):
    """A KV slot is out of range or used by two rows."""


class InvalidPageTableError(PrefillInputError):
    """A row's mapped page-table prefix is too short or names an invalid block."""


class WindowTableError(InvalidPageTableError):
    """A KV group's table does not map a block its window reads (vLLM's hit keeps those blocks).

    Entries before a sliding window may hold anything (the null block, stale
    ids of freed blocks); the ones inside it must be real blocks.
    """


class BlockConflictError(PrefillInputError):
    """One KV block would be written by two rows (or twice by one row), or read before it is whole."""


class RepeatedBlockError(BlockConflictError):
    """One row's mapped prefix names the same block at two columns (cached part included).

    A block holds one run of positions, so a row that maps it twice would
    read (or write) one position's KV as another's.
    """


class SharedBlockColumnError(BlockConflictError):
    """Two rows share a cached block at different columns.

    Prefix sharing is legal only for the same positions: a shared block
    holds the KV of one run of positions, so it must sit at one column.
    """


class BlockDependencyCycleError(BlockConflictError):
    """Rows read as cached blocks that each other write, so no run order serves them all.

    A request that reads a block another request of the call writes runs
    after it (``block_order``); a cycle of such reads has no order. The rule
    table keeps the planner from producing one.
    """


class CapacityError(PrefillInputError):
    """A prompt does not fit the page-table layout."""


class PositionLimitError(CapacityError):
    """A prompt is longer than the model's maximum position count (``max_position``).

    Rotary embeddings past the model's last position are undefined; some
    implementations clamp them silently, so the core refuses such a prompt.
    """


class InvalidSamplingError(PrefillInputError):
    """A sampling parameter is out of its domain."""


class KVCacheMismatchError(PrefillInputError):
    """A call names a KV pool other than the one the runtime was resolved with."""


class InvalidScoringRequestError(PrefillInputError):
    """A scoring request (a context and continuation, or a document) cannot be scored as given."""


class InvalidPolicyError(PrefillInputError):
    """A prefill policy is inconsistent on its own or with the layout."""


class InvalidLayoutError(PrefillInputError):
    """A page-table layout is inconsistent."""


class InvalidJSONError(PrefillInputError):
    """A value's JSON (``serialize.from_json``) is malformed, has a wrong-typed field or a key naming no field."""


class TraceBudgetError(PrefillInputError):
    """The ladder tuner's trace budget is not a positive int, or no ladder it finds fits it."""


class PrefillConfigError(PrefillError, ValueError):
    """The runtime's static configuration (model, backend, layout) is inconsistent."""


class InvalidDtypeError(PrefillConfigError):
    """A dtype request is none of ``prefill_core.values.dtype.DTYPE_REQUESTS`` (the message lists them)."""


class TraceCoverageError(PrefillError, LookupError):
    """Traced execution was asked for a shape with no captured trace.

    Raised before any model body runs; the runtime never falls back to eager
    execution on its own.
    """


class PrefillStateError(PrefillError, RuntimeError):
    """An object was used in a state that forbids the call (released, consumed)."""


class CleanupError(PrefillError, RuntimeError):
    """Releasing resources failed; ``orphans`` holds what is still alive."""

    def __init__(self, message: str, orphans: tuple = ()):
        super().__init__(message)
        self.orphans = tuple(orphans)
