"""``prefill_core.values.linear_form``: the prepacked row limit follows the probe, the margin and the setting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core.values.errors import PrefillConfigError
from prefill_core.values.linear_form import (
    ALL_ROWS,
    PREPACKED_MARGIN,
    SHORT_ROWS,
    LinearFormProbe,
    parse_prepacked_rows,
    prepacked_row_limit,
)

rates = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False)


@given(plain=rates, prepacked=rates)
def test_auto_prepacks_long_products_exactly_when_the_prepacked_form_probes_faster_by_the_margin(plain, prepacked):
    probe = LinearFormProbe("float32", 1024, plain, prepacked)
    limit = prepacked_row_limit(probe)
    assert limit == (ALL_ROWS if prepacked >= PREPACKED_MARGIN * plain else SHORT_ROWS)
    assert prepacked_row_limit(probe, "auto") == limit


@given(plain=rates, prepacked=rates, rows=st.integers(1, 1 << 20))
def test_a_setting_overrides_the_probe(plain, prepacked, rows):
    probe = LinearFormProbe("bfloat16", 1024, plain, prepacked)
    assert prepacked_row_limit(probe, "short") == SHORT_ROWS
    assert prepacked_row_limit(probe, "all") is ALL_ROWS
    assert prepacked_row_limit(probe, rows) == rows


def test_without_a_probe_auto_keeps_the_short_limit():
    assert prepacked_row_limit(None) == SHORT_ROWS


@pytest.mark.parametrize(
    ("text", "expected"), [(None, "auto"), ("", "auto"), (" ALL ", "all"), ("short", "short"), ("512", 512)]
)
def test_settings_parse(text, expected):
    assert parse_prepacked_rows(text) == expected


@pytest.mark.parametrize("text", ["0", "-3", "many", "1.5", "plain"])
def test_a_bad_setting_is_named(text):
    with pytest.raises(PrefillConfigError, match=rf"PREFILL_CPU_PREPACKED_ROWS={text!r} is invalid"):
        parse_prepacked_rows(text)


@pytest.mark.parametrize("field", ["rows", "plain_gflops", "prepacked_gflops"])
def test_a_probe_with_a_non_positive_figure_is_refused_by_field(field):
    values = {"rows": 1024, "plain_gflops": 1.0, "prepacked_gflops": 1.0, field: 0}
    with pytest.raises(PrefillConfigError, match=f"LinearFormProbe.{field}=0"):
        LinearFormProbe("float32", **values)
