"""Pooled outputs: what one row asks for (``PoolingParams``), what the model allows (``PoolerConfig``),
and the pure rules between them.

The meanings follow vLLM 0.33 (the reference for what each field means):

* ``PoolingParams`` mirrors ``vllm/pooling_params.py``: ``task`` (``"embed"``
  or ``"classify"``; vLLM's token-wise ``"token_embed"`` / ``"token_classify"``
  are refused by name, this runtime returns one vector per row),
  ``dimensions`` (Matryoshka truncation, embed only), ``normalize`` (embed
  only; ``None`` takes the model's default) and ``use_activation``
  (classify only; ``None`` means on). A field of the other task is refused,
  as vLLM's ``_verify_valid_parameters`` does.
* ``PoolerConfig`` mirrors the parts of ``vllm/config/pooler.py`` a folder
  decides: ``pooling_type`` (``seq_pooling_type``: LAST, MEAN or CLS), the
  default ``normalize`` and ``dimensions``, Matryoshka support
  (``is_matryoshka`` / ``matryoshka_dimensions`` as vLLM reads them from
  the model config), and the classification head's label count and
  activation (``vllm/model_executor/layers/pooler/activations.py``:
  ``problem_type`` regression is the identity, multi-label a sigmoid,
  otherwise a sigmoid for one label and a softmax over two or more).
* The embed head truncates to ``dimensions`` first and then normalises
  (``seqwise/heads.py`` ``EmbeddingPoolerHead.forward``); sentence-
  transformers' ``encode(truncate_dim=, normalize_embeddings=True)`` gives
  the same vector.

Two rules go further than vLLM:

* Chunking: every pooling type pools across chunks (``pooled_positions``
  says which positions of which step feed the row's vector; MEAN sums
  them across steps and divides once). vLLM refuses partial prefill for
  MEAN and CLS (``seqwise/methods.py``).
* Prefix reuse: LAST pooling (and so every classify row of a LAST model)
  needs only the last position, which a row computes whatever its cached
  prefix. MEAN and CLS need every position (CLS: position 0), which a cached
  prefix skips: ``effective_cached`` either recomputes the row from 0
  (``prefix="recompute"``) or refuses it by name (``prefix="refuse"``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from prefill_core.values.errors import PrefillConfigError, PrefillInputError, row_error

__all__ = [
    "REFUSED_TASKS",
    "ClassifyActivation",
    "InvalidPoolingError",
    "PoolerConfig",
    "PoolingParams",
    "PoolingPrefixError",
    "PoolingTask",
    "PoolingType",
    "ResolvedPooling",
    "classify_activation",
    "effective_cached",
    "pooled_positions",
    "resolve_pooling",
    "resolve_rows",
]


class InvalidPoolingError(PrefillInputError):
    """A row's pooling request breaks a rule of the model's pooler (task, dimensions, a field of the other task)."""


class PoolingPrefixError(InvalidPoolingError):
    """A row pools positions its cached prefix skips (MEAN or CLS with ``cached > 0``) and the call refuses reuse."""


class PoolingType(enum.Enum):
    """vLLM's sequence pooling types (``SequencePoolingType``): which positions make a row's vector."""

    LAST = "LAST"
    MEAN = "MEAN"
    CLS = "CLS"

    @property
    def reads_every_position(self) -> bool:
        """Whether the vector depends on positions before the last (MEAN: all of them; CLS: position 0)."""
        return self is not PoolingType.LAST


class PoolingTask(enum.Enum):
    EMBED = "embed"
    CLASSIFY = "classify"


REFUSED_TASKS = {
    "token_embed": "token-wise pooling (one vector per token) is not served: one vector per row",
    "token_classify": "token-wise pooling (one label vector per token) is not served: one vector per row",
}
"""vLLM's pooling tasks this runtime refuses, with the rule each message names."""


class ClassifyActivation(enum.Enum):
    """The activation over a classification head's logits."""

    IDENTITY = "identity"
    SIGMOID = "sigmoid"
    SOFTMAX = "softmax"


_PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def classify_activation(num_labels: int, problem_type: str | None = None) -> ClassifyActivation:
    """vLLM's ``get_classification_activation_function``: the activation a classify row gets by default.

    ``problem_type`` as transformers' config spells it; ``None`` or empty is
    the single-label rule (sigmoid for one label, softmax for more).
    """
    if problem_type == "regression":
        return ClassifyActivation.IDENTITY
    if problem_type == "multi_label_classification":
        return ClassifyActivation.SIGMOID
    if problem_type not in (None, "", "single_label_classification"):
        raise PrefillConfigError(f"problem_type={problem_type!r} is not one of {_PROBLEM_TYPES}")
    return ClassifyActivation.SIGMOID if num_labels < 2 else ClassifyActivation.SOFTMAX


def _positive_or_none(instance, attribute, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise PrefillConfigError(f"PoolerConfig.{attribute.name}={value!r} is invalid: a positive int or None")


@attrs.frozen
class PoolerConfig:
    """What a model's folder says about pooling; every row's request is resolved against it.

    ``hidden_size``: the pooled vector's width. ``normalize``: the embed
    default (sentence-transformers: whether the folder has a Normalize
    module; vLLM: True). ``dimensions``: the default truncation (None: the
    whole vector). ``matryoshka``: whether rows may ask for ``dimensions``
    at all, and ``matryoshka_dimensions`` the only ones allowed (None: any
    in ``[1, hidden_size]``), as vLLM's ``PoolingParams`` checks them.
    ``num_labels``: the classification head's rows (None: no head, so no
    classify rows); ``activation``: its default activation.
    """

    hidden_size: int = attrs.field(validator=_positive_or_none)
    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True
    dimensions: int | None = attrs.field(default=None, validator=_positive_or_none)
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    num_labels: int | None = attrs.field(default=None, validator=_positive_or_none)
    activation: ClassifyActivation | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.pooling_type, PoolingType):
            raise PrefillConfigError(f"PoolerConfig.pooling_type={self.pooling_type!r} is not a PoolingType")
        if self.dimensions is not None and self.dimensions > self.hidden_size:
            raise PrefillConfigError(
                f"PoolerConfig.dimensions={self.dimensions} is invalid: at most hidden_size={self.hidden_size}"
            )
        if self.matryoshka_dimensions is not None:
            bad = [d for d in self.matryoshka_dimensions if not isinstance(d, int) or not 1 <= d <= self.hidden_size]
            if bad or not self.matryoshka_dimensions:
                raise PrefillConfigError(
                    f"PoolerConfig.matryoshka_dimensions={self.matryoshka_dimensions!r} is invalid: "
                    f"a non-empty tuple of ints in [1, {self.hidden_size}]"
                )
        if (self.num_labels is None) != (self.activation is None):
            raise PrefillConfigError("PoolerConfig: num_labels and activation are given together (a head) or not")

    @property
    def tasks(self) -> frozenset[PoolingTask]:
        """The tasks rows may ask for: embed always, classify where the model has a head."""
        if self.num_labels is None:
            return frozenset({PoolingTask.EMBED})
        return frozenset(PoolingTask)


@attrs.frozen
class PoolingParams:
    """What one row asks for, as vLLM's ``PoolingParams`` (``None`` fields take the model's defaults).

    Values are checked against the model's ``PoolerConfig`` by
    ``resolve_pooling``, which names the row, field, value and rule.
    """

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    @classmethod
    def embed(cls, *, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        return cls("embed", dimensions=dimensions, normalize=normalize)

    @classmethod
    def classify(cls, *, use_activation: bool | None = None) -> PoolingParams:
        return cls("classify", use_activation=use_activation)


@attrs.frozen
class ResolvedPooling:
    """One row's pooling after defaults and checks: what the shell computes for it.

    ``dimensions``: truncate the pooled vector to this width (embed; None:
    keep it whole). ``normalize``: L2-normalise after truncating (embed).
    ``activation``: over the head's logits (classify; IDENTITY where the row
    turned it off).
    """

    task: PoolingTask
    pooling_type: PoolingType
    dimensions: int | None = None
    normalize: bool = False
    activation: ClassifyActivation = ClassifyActivation.IDENTITY

    @property
    def reads_every_position(self) -> bool:
        return self.pooling_type.reads_every_position


def _bool_or_none(row: int, field: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise row_error(InvalidPoolingError, row, field, value, "a bool or None")


def resolve_pooling(row: int, params: PoolingParams, config: PoolerConfig) -> ResolvedPooling:
    """Row ``row``'s request merged with the model's defaults, or an ``InvalidPoolingError`` naming the rule.

    The order follows vLLM's ``PoolingParams.verify``: the task, then the
    fields the task does not take, then the task's own fields.
    """
    if not isinstance(params, PoolingParams):
        raise row_error(InvalidPoolingError, row, "pooling", params, "a PoolingParams")
    task_name = params.task
    if task_name in REFUSED_TASKS:
        raise row_error(InvalidPoolingError, row, "task", task_name, REFUSED_TASKS[task_name])
    try:
        task = PoolingTask(task_name)
    except ValueError:
        raise row_error(InvalidPoolingError, row, "task", task_name, "one of 'embed', 'classify'") from None
    if task not in config.tasks:
        raise row_error(InvalidPoolingError, row, "task", task_name, "the model has no classification head")
    _bool_or_none(row, "normalize", params.normalize)
    _bool_or_none(row, "use_activation", params.use_activation)
    if task is PoolingTask.CLASSIFY:
        for field in ("dimensions", "normalize"):
            if getattr(params, field) is not None:
                raise row_error(
                    InvalidPoolingError,
                    row,
                    field,
                    getattr(params, field),
                    "an embed field: classify takes use_activation only",
                )
        on = params.use_activation is not False
        activation = config.activation if on else ClassifyActivation.IDENTITY
        return ResolvedPooling(task, config.pooling_type, activation=activation)
    if params.use_activation is not None:
        raise row_error(
            InvalidPoolingError,
            row,
            "use_activation",
            params.use_activation,
            "a classify field: embed takes dimensions and normalize",
        )
    dimensions = params.dimensions
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise row_error(InvalidPoolingError, row, "dimensions", dimensions, "an int or None")
        if not config.matryoshka:
            raise row_error(
                InvalidPoolingError, row, "dimensions", dimensions, "the model does not declare Matryoshka embeddings"
            )
        if config.matryoshka_dimensions is not None and dimensions not in config.matryoshka_dimensions:
            rule = f"one of the model's Matryoshka dimensions {list(config.matryoshka_dimensions)}"
            raise row_error(InvalidPoolingError, row, "dimensions", dimensions, rule)
        if not 1 <= dimensions <= config.hidden_size:
            raise row_error(InvalidPoolingError, row, "dimensions", dimensions, f"in [1, {config.hidden_size}]")
    else:
        dimensions = config.dimensions
    normalize = config.normalize if params.normalize is None else params.normalize
    return ResolvedPooling(task, config.pooling_type, dimensions=dimensions, normalize=normalize)


def resolve_rows(
    pooling: PoolingParams | Sequence[PoolingParams], num_rows: int, config: PoolerConfig
) -> tuple[ResolvedPooling, ...]:
    """Each row's ``ResolvedPooling``: one ``PoolingParams`` for every row, or a sequence of one per row."""
    if isinstance(pooling, PoolingParams):
        one = resolve_pooling(0, pooling, config)
        return (one,) * num_rows
    if isinstance(pooling, (str, bytes)) or not isinstance(pooling, Sequence):
        raise InvalidPoolingError(f"pooling={pooling!r} is invalid: a PoolingParams or one per row", field="pooling")
    if len(pooling) != num_rows:
        raise InvalidPoolingError(
            f"pooling has {len(pooling)} entries for {num_rows} rows: one per row", field="pooling"
        )
    return tuple(resolve_pooling(row, params, config) for row, params in enumerate(pooling))


def effective_cached(
    rows: Sequence[ResolvedPooling], cached: Sequence[int], *, prefix: str = "recompute"
) -> tuple[int, ...]:
    """The cached length each row may use: its own where its pooling reads only the last position, else 0.

    ``prefix="recompute"``: a MEAN or CLS row with a cached prefix computes
    from position 0 (its KV blocks are rewritten with the same values, so
    a cache stays whole); ``prefix="refuse"``: such a row raises
    ``PoolingPrefixError`` naming it and ``cached_lengths``.
    """
    if prefix not in ("recompute", "refuse"):
        raise InvalidPoolingError(f"prefix={prefix!r} is invalid: 'recompute' or 'refuse'", field="prefix")
    if len(rows) != len(cached):
        raise InvalidPoolingError(f"{len(cached)} cached lengths for {len(rows)} rows", field="cached_lengths")
    out = []
    for row, (pooling, length) in enumerate(zip(rows, cached)):
        if length and pooling.reads_every_position:
            if prefix == "refuse":
                rule = f"{pooling.pooling_type.value} pooling reads every position, and a cached prefix skips them"
                raise row_error(PoolingPrefixError, row, "cached_lengths", length, rule)
            length = 0
        out.append(length)
    return tuple(out)


def pooled_positions(
    pooling_type: PoolingType, length: int, segments: Sequence[tuple[int, int]]
) -> tuple[tuple[int, int, int], ...]:
    """Which computed positions feed a row's vector: ``(segment index, first, end)`` per used segment.

    ``segments``: the ``(start, length)`` runs the row's steps compute, in
    step order (a chunked row's chunks, a packed row's segments; a padded
    wave may recompute part of a cached prefix). LAST takes position
    ``length - 1``, CLS position 0, MEAN every position in ``[0, length)``,
    each once (the first segment that computes it). A needed position no
    segment computes raises ``PoolingPrefixError`` (row -1: the caller names
    the row).
    """
    if length < 1:
        raise InvalidPoolingError(f"length={length} is invalid: a row pools at least one position", field="length")
    wanted = {
        PoolingType.LAST: (length - 1, length),
        PoolingType.CLS: (0, 1),
        PoolingType.MEAN: (0, length),
    }[pooling_type]
    out, covered = [], wanted[0]
    for index, (start, run) in enumerate(segments):
        first, end = max(covered, start), min(wanted[1], start + run)
        if first > covered or first >= end:
            continue
        out.append((index, first, end))
        covered = end
    if covered < wanted[1]:
        rule = f"{pooling_type.value} pooling needs positions [{wanted[0]}, {wanted[1]}), computed up to {covered}"
        raise PoolingPrefixError(f"position {covered} is not computed: {rule}", field="cached_lengths")
    return tuple(out)
