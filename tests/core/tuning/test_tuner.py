"""The ladder tuner: never worse than tt-metal's ladder within its trace count, optimal over rung subsets,
within budget, deterministic; histogram files parse and name their bad lines; the CLI prints both ladders."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import PrefillPolicy, TraceBudgetError
from prefill_core.__main__ import main
from prefill_core.tuning.histogram import HistogramEntry, histogram_text, parse_histogram
from prefill_core.tuning.tuner import measure, tune
from prefill_core.values.errors import ArgumentError
from tests.strategies import BLOCK_SIZES, histograms

HISTOGRAMS = Path(__file__).resolve().parents[3] / "benchmarks" / "histograms"
MAX_CHUNKS = (512, 1024, 2048, 4096)


@given(st.data())
def test_a_budget_of_the_defaults_trace_count_never_computes_more_positions(data):
    """With a budget >= the default's trace count, the tuned ladder stays in budget and computes no more positions."""
    bs = data.draw(st.sampled_from(BLOCK_SIZES))
    default = PrefillPolicy(max_chunk_length=data.draw(st.sampled_from(MAX_CHUNKS)))
    entries = data.draw(histograms(bs))
    budget = measure(default, entries, bs).traces + data.draw(st.integers(0, 3))
    result = tune(entries, block_size=bs, max_traces=budget, default=default)
    assert result.cost.traces <= budget
    assert result.cost.positions <= result.default_cost.positions
    assert result.policy.max_chunk_length <= default.max_chunk_length
    assert measure(result.policy, entries, bs) == result.cost


@given(st.data())
def test_no_ladder_of_candidate_rungs_beats_the_tuner_within_its_budget(data):
    """Every ladder made of the works' rounded values (max chunk fixed) computes at least the tuner's positions."""
    bs = data.draw(st.sampled_from(BLOCK_SIZES))
    entries = data.draw(histograms(bs, max_length=1024, max_entries=5))
    _assert_no_subset_ladder_beats_the_tuner(bs, entries, data.draw(st.integers(2, 5)))


@pytest.mark.parametrize(
    ("entries", "budget"),
    [
        (((1024, 0), (353, 1), (16, 16)), 2),
        (((128, 16), (1024, 0), (353, 1), (1, 0)), 3),
    ],
)
def test_rows_cached_inside_a_block_are_tuned_for_the_block_they_recompute(entries, budget):
    """A row cached inside a block costs the work the planner gives it (from that block's start), not
    length - cached: counted short, the tuner missed a 2-trace ladder and over-spent another (make fuzz-core)."""
    _assert_no_subset_ladder_beats_the_tuner(16, tuple(HistogramEntry(n, 1, c) for n, c in entries), budget)


def _assert_no_subset_ladder_beats_the_tuner(bs: int, entries: tuple, budget: int) -> None:
    default = PrefillPolicy(max_chunk_length=1024)
    unit = max(bs, default.tile_size)
    works = {max(e.length - e.cached, 1) if e.cached < e.length else bs for e in entries}
    values = sorted({-(-w // unit) * unit for w in works})
    best = None
    for size in range(len(values)):
        for lower in itertools.combinations(values[:-1], size):
            policy = PrefillPolicy(length_ladder=(*lower, values[-1]), max_chunk_length=1024)
            cost = measure(policy, entries, bs)
            if cost.traces <= budget and (best is None or cost.positions < best):
                best = cost.positions
    try:
        result = tune(entries, block_size=bs, max_traces=budget, default=default)
    except TraceBudgetError:
        assert best is None
        return
    assert best is None or result.cost.positions <= best


@given(st.data())
def test_tuning_is_deterministic(data):
    """The same histogram, budget and default give the same ladder, max chunk and cost."""
    bs = data.draw(st.sampled_from(BLOCK_SIZES))
    entries = data.draw(histograms(bs))
    budget = data.draw(st.integers(2, 8))
    runs = []
    for _ in range(2):
        try:
            runs.append(tune(entries, block_size=bs, max_traces=budget))
        except TraceBudgetError as error:
            runs.append(str(error))
    assert runs[0] == runs[1]


def test_a_budget_below_what_any_ladder_needs_is_a_named_error():
    """Regular and cached prompts need two traces at least; a budget of 1 (or 0) is a TraceBudgetError on max_traces."""
    entries = (HistogramEntry(100, 1, 0), HistogramEntry(300, 1, 64))
    for budget in (0, 1):
        with pytest.raises(TraceBudgetError, match="max_traces") as caught:
            tune(entries, block_size=32, max_traces=budget)
        assert caught.value.field == "max_traces"


def test_short_prompts_get_rungs_at_their_lengths():
    """Prompts of 40, 100 and 300 tokens with three traces get rungs 64, 128 and 320 (block 32): what they need."""
    entries = (HistogramEntry(40, 5, 0), HistogramEntry(100, 2, 0), HistogramEntry(300, 1, 0))
    result = tune(entries, block_size=32, max_traces=3)
    assert result.policy.length_ladder == (64, 128, 320)
    assert (result.cost.positions, result.cost.traces) == (5 * 64 + 2 * 128 + 320, 3)
    assert (result.default_cost.positions, result.default_cost.traces) == (7 * 128 + 1024, 2)


def test_long_prompts_step_by_the_max_chunk():
    """A 5000-token prompt runs three 2048-token chunks under the tuned ladder (tt-metal's pads it to 8192: four)."""
    result = tune((HistogramEntry(5000, 1, 0),), block_size=32, max_traces=1)
    assert (result.cost.positions, result.cost.traces) == (3 * 2048, 1)
    assert result.default_cost.positions == 3 * 2048  # planning stops after the chunk holding the last token


# ---------------------------------------------------------------- histogram files


@given(st.data())
def test_histogram_text_parses_back_equal(data):
    """histogram_text writes entries that parse_histogram reads back unchanged."""
    bs = data.draw(st.sampled_from(BLOCK_SIZES))
    entries = data.draw(histograms(bs))
    assert parse_histogram(histogram_text(entries), block_size=bs) == entries


def test_a_shared_cached_prefix_fills_lines_without_one_in_whole_blocks():
    """--cached 100 at block 32 caches 96 tokens of long lines, all but a partial block of short ones, never all."""
    text = "# comment\n\n500 3\n50\n32 1\n200 2 128  # explicit\n"
    entries = parse_histogram(text, block_size=32, cached=100)
    assert entries == (
        HistogramEntry(500, 3, 96),
        HistogramEntry(50, 1, 32),
        HistogramEntry(32, 1, 0),
        HistogramEntry(200, 2, 128),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("100\nabc 2\n", "line 2: length 'abc'"),
        ("0 1\n", "line 1: length '0'"),
        ("100 0\n", "line 1: count '0'"),
        ("100 1 200\n", "line 1: cached 200 exceeds the length 100"),
        ("100 1 0 7\n", "line 1: '100 1 0 7' has more than"),
        ("# only a comment\n", "no entries"),
    ],
)
def test_bad_histogram_lines_are_named(text, message):
    """A malformed line is an ArgumentError naming its line number and value."""
    with pytest.raises(ArgumentError, match=message):
        parse_histogram(text, block_size=32)


def test_the_cli_prints_the_default_and_the_tuned_ladder(capsys):
    """`python -m prefill_core tune` on the short-chat histogram prints both ladders, the tuned one within budget."""
    assert main(["tune", "--lengths", str(HISTOGRAMS / "short_chat.txt"), "--max-traces", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["ladder", "default", "tuned"]
    assert lines[1].split()[1] == "3" and int(lines[2].split()[1]) <= 4


def test_the_cli_reports_a_missing_file_and_a_bad_budget(capsys, tmp_path):
    """A missing histogram file and a budget no ladder fits each exit 2 with one error line."""
    assert main(["tune", "--lengths", str(tmp_path / "none.txt"), "--max-traces", "4"]) == 2
    assert "none.txt" in capsys.readouterr().err
    (tmp_path / "h.txt").write_text("100\n300 1 64\n")
    assert main(["tune", "--lengths", str(tmp_path / "h.txt"), "--max-traces", "1"]) == 2
    assert "max_traces" in capsys.readouterr().err
