"""prefill_core.values.pooling: per-row pooling requests against the model's pooler, prefix reuse and chunking rules.

The meanings are vLLM 0.33's (vllm/pooling_params.py, vllm/config/pooler.py,
vllm/model_executor/layers/pooler/activations.py); the chunking and prefix
rules are this runtime's (module docstring of prefill_core.values.pooling).
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core.values.errors import PrefillConfigError, PrefillInputError
from prefill_core.values.pooling import (
    ClassifyActivation,
    InvalidPoolingError,
    PoolerConfig,
    PoolingParams,
    PoolingPrefixError,
    PoolingTask,
    PoolingType,
    classify_activation,
    effective_cached,
    pooled_positions,
    resolve_pooling,
    resolve_rows,
)
from tests.strategies import chunk_runs, pooler_configs, pooling_params


@given(data=st.data())
def test_a_valid_request_resolves_to_its_fields_or_the_models_defaults(data):
    config = data.draw(pooler_configs())
    params = data.draw(pooling_params(config))
    row = data.draw(st.integers(0, 100))
    resolved = resolve_pooling(row, params, config)
    assert resolved.pooling_type is config.pooling_type
    assert resolved.task is PoolingTask(params.task)
    if resolved.task is PoolingTask.EMBED:
        assert resolved.dimensions == (config.dimensions if params.dimensions is None else params.dimensions)
        assert resolved.normalize == (config.normalize if params.normalize is None else params.normalize)
        assert resolved.activation is ClassifyActivation.IDENTITY
    else:
        off = params.use_activation is False
        assert resolved.activation is (ClassifyActivation.IDENTITY if off else config.activation)
        assert resolved.dimensions is None and resolved.normalize is False
    # One request for every row is the same as that request per row.
    assert resolve_rows(params, 3, config) == resolve_rows([params] * 3, 3, config) == (resolved,) * 3


def _breakers(config: PoolerConfig) -> dict[str, tuple[str, PoolingParams]]:
    """One broken request per rule, with the field the error must name."""
    out = {
        "token_embed": ("task", PoolingParams("token_embed")),
        "token_classify": ("task", PoolingParams("token_classify")),
        "unknown task": ("task", PoolingParams("generate")),
        "normalize not a bool": ("normalize", PoolingParams.embed(normalize=1)),
        "use_activation on embed": ("use_activation", PoolingParams("embed", use_activation=True)),
        "dimensions not an int": ("dimensions", PoolingParams("embed", dimensions=2.0)),
    }
    if config.num_labels is None:
        out["classify without a head"] = ("task", PoolingParams.classify())
    else:
        out["dimensions on classify"] = ("dimensions", PoolingParams("classify", dimensions=1))
        out["normalize on classify"] = ("normalize", PoolingParams("classify", normalize=True))
        out["use_activation not a bool"] = ("use_activation", PoolingParams("classify", use_activation="yes"))
    if not config.matryoshka:
        out["dimensions without Matryoshka"] = ("dimensions", PoolingParams.embed(dimensions=1))
    else:
        out["dimensions past hidden"] = ("dimensions", PoolingParams.embed(dimensions=config.hidden_size + 1))
        out["dimensions zero"] = ("dimensions", PoolingParams.embed(dimensions=0))
        if config.matryoshka_dimensions is not None:
            missing = next(d for d in range(1, config.hidden_size + 2) if d not in config.matryoshka_dimensions)
            out["dimensions not declared"] = ("dimensions", PoolingParams.embed(dimensions=missing))
    return out


@given(data=st.data())
def test_each_broken_rule_is_a_named_error_for_its_row_and_field(data):
    config = data.draw(pooler_configs())
    breakers = _breakers(config)
    rule = data.draw(st.sampled_from(sorted(breakers)))
    field, broken = breakers[rule]
    rows = data.draw(st.lists(pooling_params(config), min_size=1, max_size=6))
    row = data.draw(st.integers(0, len(rows) - 1))
    rows[row] = broken
    with pytest.raises(InvalidPoolingError) as caught:
        resolve_rows(rows, len(rows), config)
    # The first broken row is named; valid rows before it raise nothing.
    assert (caught.value.row, caught.value.field) == (row, field)
    assert f"row {row}: {field}=" in str(caught.value) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize("task", ["token_embed", "token_classify"])
def test_token_wise_tasks_are_refused_by_name(task):
    with pytest.raises(InvalidPoolingError, match=f"task='{task}'.*token-wise"):
        resolve_pooling(0, PoolingParams(task), PoolerConfig(hidden_size=8))


def test_a_request_list_of_the_wrong_length_or_type_is_refused():
    config = PoolerConfig(hidden_size=8)
    with pytest.raises(InvalidPoolingError, match="2 entries for 3 rows"):
        resolve_rows([PoolingParams()] * 2, 3, config)
    with pytest.raises(InvalidPoolingError, match="a PoolingParams or one per row"):
        resolve_rows("embed", 3, config)
    with pytest.raises(InvalidPoolingError, match="row 1: pooling="):
        resolve_rows([PoolingParams(), {"task": "embed"}], 2, config)


@pytest.mark.parametrize(
    ("num_labels", "problem_type", "expected"),
    [
        # vllm/model_executor/layers/pooler/activations.py get_classification_activation_function + PoolerClassify
        (1, None, ClassifyActivation.SIGMOID),
        (2, None, ClassifyActivation.SOFTMAX),
        (5, "single_label_classification", ClassifyActivation.SOFTMAX),
        (1, "single_label_classification", ClassifyActivation.SIGMOID),
        (3, "multi_label_classification", ClassifyActivation.SIGMOID),
        (3, "regression", ClassifyActivation.IDENTITY),
    ],
)
def test_the_default_activation_is_vllms(num_labels, problem_type, expected):
    assert classify_activation(num_labels, problem_type) is expected


def test_a_config_that_cannot_be_is_a_config_error():
    with pytest.raises(PrefillConfigError, match="problem_type"):
        classify_activation(2, "ranking")
    with pytest.raises(PrefillConfigError, match="dimensions=9"):
        PoolerConfig(hidden_size=8, dimensions=9)
    with pytest.raises(PrefillConfigError, match="matryoshka_dimensions"):
        PoolerConfig(hidden_size=8, matryoshka=True, matryoshka_dimensions=(4, 16))
    with pytest.raises(PrefillConfigError, match="num_labels and activation"):
        PoolerConfig(hidden_size=8, num_labels=2)
    with pytest.raises(PrefillConfigError, match="hidden_size"):
        PoolerConfig(hidden_size=0)


@given(data=st.data())
def test_prefix_reuse_serves_last_pooling_and_recomputes_or_refuses_the_others(data):
    config = data.draw(pooler_configs())
    rows = data.draw(st.lists(pooling_params(config), min_size=1, max_size=8))
    resolved = resolve_rows(rows, len(rows), config)
    cached = data.draw(st.lists(st.sampled_from([0, 16, 100]), min_size=len(rows), max_size=len(rows)))
    kept = effective_cached(resolved, cached)
    last = config.pooling_type is PoolingType.LAST
    assert kept == (tuple(cached) if last else (0,) * len(rows))
    offenders = [] if last else [row for row, c in enumerate(cached) if c]
    if offenders:
        with pytest.raises(PoolingPrefixError) as caught:
            effective_cached(resolved, cached, prefix="refuse")
        assert (caught.value.row, caught.value.field) == (offenders[0], "cached_lengths")
        assert config.pooling_type.value in str(caught.value)
    else:
        assert effective_cached(resolved, cached, prefix="refuse") == tuple(cached)


@given(runs=chunk_runs(), pooling_type=st.sampled_from(list(PoolingType)))
def test_every_pooling_type_pools_across_chunks_from_the_positions_it_needs(runs, pooling_type):
    length, cached, segments = runs
    needs_all = pooling_type.reads_every_position
    if needs_all and segments[0][0] > 0:
        # A cached prefix skips positions MEAN and CLS need: never a vector from part of the row. (A fully
        # cached row's padded re-run may recompute position 0 of a short row: then nothing is skipped.)
        with pytest.raises(PoolingPrefixError):
            pooled_positions(pooling_type, length, segments)
        return
    picks = pooled_positions(pooling_type, length, segments)
    positions = [p for index, first, end in picks for p in range(first, end)]
    for index, first, end in picks:
        start, run = segments[index]
        assert start <= first < end <= start + run
    expected = {PoolingType.LAST: [length - 1], PoolingType.CLS: [0], PoolingType.MEAN: list(range(length))}
    assert positions == expected[pooling_type]  # each needed position exactly once, in order


def test_resolved_values_are_frozen():
    resolved = resolve_pooling(0, PoolingParams(), PoolerConfig(hidden_size=8))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        resolved.normalize = False
    assert issubclass(InvalidPoolingError, PrefillInputError)
