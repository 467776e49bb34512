"""The plugin's per-row sampling encodings, mapped once per distinct encoding: each row as if mapped alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefill_core.values.errors import InvalidSamplingError
from prefill_shell.serving.plugin_sampling import rows_from_plugin
from tests.strategies import PLUGIN_FIELD_VALUES, plugin_encodings

VOCAB = 256


def _columns(rows: list[dict], as_tensors: bool) -> dict:
    """The plugin's fields: one list (or 1-D tensor) per field, one entry per row."""
    columns = {name: [row[name] for row in rows] for name in PLUGIN_FIELD_VALUES}
    return {name: torch.tensor(column) for name, column in columns.items()} if as_tensors else columns


@given(plugin_encodings(), st.booleans())
def test_each_row_maps_as_if_alone_and_equal_encodings_share_one_mapping(rows, as_tensors):
    """Row i equals row i sent alone; rows with equal encodings share one mapping; the facade's lists agree."""
    columns = _columns(rows, as_tensors)
    plugin = rows_from_plugin(SimpleNamespace(**columns), len(rows), VOCAB)
    for i in range(len(rows)):
        alone = rows_from_plugin(SimpleNamespace(**{name: c[i] for name, c in columns.items()}), 1, VOCAB)
        assert plugin.rows[i] == alone.rows[0]
        for j in range(i):
            assert (plugin.rows[i] is plugin.rows[j]) == (rows[i] == rows[j])
    assert plugin.penalised == [i for i, s in enumerate(plugin.rows) if not s.penalties.neutral]
    assert plugin.core == [None if i in plugin.penalised else s.params for i, s in enumerate(plugin.rows)]
    assert plugin.logprob_rows == [i for i, s in enumerate(plugin.rows) if s.wants_logprob]


@pytest.mark.parametrize(
    ("field", "bad"),
    [("presence_penalty", 2.5), ("frequency_penalty", True), ("repetition_penalty", 0.0), ("num_logprobs", -1)],
)
def test_a_bad_row_is_named_at_the_first_row_holding_its_encoding(field, bad):
    """Rows 1 and 3 share a bad value: the error names row 1 and the field, whatever the other rows hold."""
    good = {name: values[0] for name, values in PLUGIN_FIELD_VALUES.items()}
    rows = [good, good | {field: bad}, good | {"temperature": 0.7}, good | {field: bad}]
    with pytest.raises(InvalidSamplingError, match=rf"row 1: sampling_params\.{field}=") as caught:
        rows_from_plugin(SimpleNamespace(**_columns(rows, as_tensors=False)), len(rows), VOCAB)
    assert caught.value.row == 1 and caught.value.field == f"sampling_params.{field}"


@pytest.mark.parametrize("field", ["temperature", "top_k", "enable_log_probs", "seed"])
@pytest.mark.parametrize("nested", [[[1], [1]], [[1], [2]], torch.ones(2, 1)])
def test_a_nested_per_row_field_is_a_named_error_never_fewer_rows(field, nested):
    """A 2-D tensor or list of lists (equal rows or not) names the field and row; it never maps fewer rows."""
    good = {name: values[0] for name, values in PLUGIN_FIELD_VALUES.items()}
    columns = _columns([good, good], as_tensors=False) | {field: nested}
    with pytest.raises(InvalidSamplingError, match=rf"row 0: sampling_params\.{field}=.*nested") as caught:
        rows_from_plugin(SimpleNamespace(**columns), 2, VOCAB)
    assert caught.value.row == 0 and caught.value.field == f"sampling_params.{field}"


@pytest.mark.parametrize(("field", "values"), [("top_k", [1, True]), ("seed", [1, True]), ("temperature", [1, 1.0])])
def test_equal_values_of_different_types_map_each_row_as_if_alone(field, values):
    """1 == True == 1.0, yet a row's True stays a bool (the core's rules refuse it at that row), never row 0's 1."""
    good = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": -1, "num_logprobs": -2}
    columns = {name: [value, value] for name, value in good.items()} | {field: values}
    plugin = rows_from_plugin(SimpleNamespace(**columns), 2, VOCAB)
    for row in range(2):
        alone = rows_from_plugin(SimpleNamespace(**(good | {field: values[row]})), 1, VOCAB)
        assert plugin.rows[row] == alone.rows[0]
        assert type(getattr(plugin.rows[row].params, field)) is type(values[row])
