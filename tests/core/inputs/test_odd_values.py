"""Odd but legal values and malformed CLI input: each plans correctly or fails with a named error."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import (
    InvalidCachedLengthError,
    InvalidJSONError,
    InvalidLayoutError,
    InvalidPolicyError,
    PageTableLayout,
    PrefillBatch,
    PrefillInputError,
    PrefillPolicy,
    PrefillRow,
    PreparedPrefill,
    SamplingParams,
    from_json,
    manifest_for,
    prepare_prefill,
    to_json,
)
from prefill_core.__main__ import main
from prefill_core.cli.explain import MAX_SAMPLE_BLOCKS
from prefill_core.tuning.histogram import HistogramEntry, parse_histogram
from prefill_core.tuning.tuner import tune
from tests.core.plan_checks import expected_writes, writes_by_source_row


@pytest.mark.parametrize(
    ("policy", "block_size", "length"),
    [
        (PrefillPolicy.fine_rungs(32), 32, 2048),  # the last bucket of a fine ladder, at full capacity
        (PrefillPolicy(length_ladder=(64,)), 64, 100),  # a bucket one block wide
        (PrefillPolicy(tile_size=64, length_ladder=()), 64, 74),
    ],
)
def test_manifest_covers_a_row_cached_inside_its_first_block(policy, block_size, length):
    """A row cached inside its first block recomputes its whole length: its chunk body is in the manifest."""
    width = -(-length // block_size)
    layout = PageTableLayout(block_size, width, width)
    for cached in (1, block_size // 2, min(block_size - 1, length - 1)):
        batch = PrefillBatch.from_rows([PrefillRow(length, cached, 0, tuple(range(width)))])
        (prepared,) = prepare_prefill(batch, policy, layout)
        assert prepared.request.first_chunk_start == 0
        assert manifest_for(policy, layout).covers(prepared)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--lengths", "100", "--block", "0"],
        ["plan", "--lengths", "100", "--max-chunk", "-5"],
        ["manifest", "--max-length", "0"],
        ["tune", "--lengths", "LENGTHS", "--max-traces", "4", "--block", "0"],
        ["tune", "--lengths", "LENGTHS", "--max-traces", "4", "--cached", "-5"],
    ],
)
def test_a_non_positive_cli_size_is_a_usage_error(argv, tmp_path, capsys):
    """--block 0, a negative --max-chunk or --cached, --max-length 0: argparse's usage error (exit 2), no traceback."""
    (tmp_path / "h.txt").write_text("100 2\n")
    argv = [str(tmp_path / "h.txt") if a == "LENGTHS" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error: argument --" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["plan", "--lengths", "99999999999"], None),
        (["plan", "--lengths", "1048577x32"], None),
        (["tune", "--lengths", "LENGTHS", "--max-traces", "4"], "99999999999999999999 3\n"),
    ],
)
def test_a_sample_past_the_cli_block_limit_is_a_named_error(argv, text, tmp_path, capsys):
    """Rows needing more than MAX_SAMPLE_BLOCKS block ids exit 2 with one line, not a MemoryError or a hang."""
    (tmp_path / "h.txt").write_text(text or "")
    argv = [str(tmp_path / "h.txt") if a == "LENGTHS" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --lengths:") and f"at most {MAX_SAMPLE_BLOCKS}" in err
    assert len(err.strip().splitlines()) == 1


def test_a_histogram_with_a_byte_order_mark_or_crlf_parses_like_plain_text(tmp_path, capsys):
    """A UTF-8 byte-order mark and CRLF line ends read as the plain file does; undecodable bytes exit 2."""
    outputs = []
    for name, data in (("plain", b"100 2\n200\n"), ("bom", b"\xef\xbb\xbf100 2\r\n200\r\n")):
        (tmp_path / name).write_bytes(data)
        assert main(["tune", "--lengths", str(tmp_path / name), "--max-traces", "4"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    assert main(["tune", "--lengths", str(tmp_path / "binary"), "--max-traces", "4"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_a_huge_trace_budget_or_max_chunk_tunes_like_a_sufficient_one():
    """--max-traces 10**11 and a 2**40 max chunk pick what a just-sufficient budget and max chunk pick, quickly."""
    entries = parse_histogram("100 2\n200\n3000 1 64\n", block_size=32)
    plain = tune(entries, block_size=32, max_traces=8)
    assert tune(entries, block_size=32, max_traces=10**11).cost == plain.cost
    huge = tune(entries, block_size=32, max_traces=8, default=PrefillPolicy(max_chunk_length=1 << 40))
    wide = tune(entries, block_size=32, max_traces=8, default=PrefillPolicy(max_chunk_length=8192))
    assert (huge.policy.max_chunk_length, huge.cost) == (wide.policy.max_chunk_length, wide.cost)
    assert huge.cost.positions <= huge.default_cost.positions


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ('{"batching_enabled": "false"}', "PrefillPolicy.batching_enabled"),
        ('{"max_chunk_length": 2048.5}', "PrefillPolicy.max_chunk_length"),
        ('{"tile_size": true}', "PrefillPolicy.tile_size"),
        ('{"waves": [1, 2.5]}', "PrefillPolicy.waves[1]"),
        ('{"max_chunk_len": 1024}', "extra fields found (max_chunk_len)"),
        ("{", "PrefillPolicy JSON is invalid"),
    ],
)
def test_policy_json_of_a_wrong_type_or_an_unknown_key_is_refused_not_coerced(text, path):
    """from_json refuses "false" for a bool, a float or bool for an int and a misspelt key, naming the path."""
    with pytest.raises(InvalidJSONError) as error:
        from_json(PrefillPolicy, text)
    assert path in str(error.value)


def test_json_a_value_refuses_raises_the_values_own_error():
    """A well-typed field the value itself refuses (a 48-token block, wave 3) raises the value's named error."""
    with pytest.raises(InvalidLayoutError, match="block_size=48"):
        from_json(PageTableLayout, '{"block_size": 48, "max_num_blocks_per_seq": 1, "num_blocks": 1}')
    with pytest.raises(InvalidPolicyError, match="wave 3"):
        from_json(PrefillPolicy, '{"waves": [3]}')


def test_evolved_and_odd_values_round_trip_exactly():
    """Evolved policies (unsorted trace lengths, one rung), an int temperature and prompt log-probs round-trip equal."""
    policy = attrs.evolve(PrefillPolicy(), trace_lengths=(256, 128), length_ladder=(64,), max_logprobs=0)
    assert from_json(PrefillPolicy, to_json(policy)) == policy
    params = SamplingParams(temperature=1, top_k=3, top_p=1, seed=2**63 - 1, prompt_logprobs=0)
    assert from_json(SamplingParams, to_json(params)) == params


@st.composite
def _odd_configurations(draw):
    """A policy the shared strategies never draw (a tile unlike 32, any quantum, waves without 1, tiny limits),
    a layout it fits, and a batch of fresh rows, cached anywhere."""
    bs = draw(st.sampled_from((1, 2, 16, 64)))
    tile = draw(st.sampled_from((1, 3, 48, 64, 96, bs, 3 * bs)))
    unit = math.lcm(tile, bs)
    ladder = tuple(sorted(draw(st.sets(st.integers(1, 12).map(lambda k: k * unit), max_size=3))))
    if not ladder and tile % bs:
        ladder = (unit,)
    max_chunk = draw(st.integers(1, 24)) * unit
    policy = PrefillPolicy(
        tile_size=tile,
        waves=tuple(sorted(draw(st.sets(st.sampled_from((1, 2, 4, 8, 64)), min_size=1)))),
        length_ladder=ladder,
        max_chunk_length=max_chunk,
        chunk_quantum=draw(st.sampled_from((max_chunk, unit, 3 * unit, 5 * bs, 10**6))),
        batching_enabled=draw(st.booleans()),
        max_batch_size=draw(st.integers(1, 70)),
        lane_size=draw(st.integers(1, 12)),
        max_batched_tokens=draw(st.sampled_from((1, 100, 2048, 10**9))),
        pad_partial_waves=draw(st.booleans()),
        table_width_multiple=draw(st.integers(1, 10)),
        max_logprobs=draw(st.integers(0, 2)),
        static_last_token_tile=draw(st.booleans()),
    )
    width = draw(st.integers(1, 40))
    rows, block = [], 0
    for slot in range(draw(st.integers(1, policy.lane_size))):
        length = draw(st.integers(1, width * bs))
        inside_first_block = st.integers(0, min(length, bs - 1))
        cached = draw(st.one_of(st.just(0), st.just(length), st.integers(0, length), inside_first_block))
        need = -(-length // bs)
        rows.append(PrefillRow(length, cached, slot, tuple(range(block, block + need))))
        block += need
    return policy, PageTableLayout(bs, width, block), PrefillBatch.from_rows(rows)


@given(_odd_configurations())
def test_odd_policies_plan_every_invariant_and_the_manifest_covers_them(configuration):
    """Each row once, exactly its own written blocks, its last token in the final chunk, no step past the max chunk,
    an exact JSON round trip, and a manifest that covers the plan."""
    policy, layout, batch = configuration
    bs = layout.block_size
    prepared = prepare_prefill(batch, policy, layout)
    requests = tuple(p.request for p in prepared)
    assert sorted(row for r in requests for row in r.source_rows) == list(range(len(batch)))
    written = {row: sorted(w) for row, w in writes_by_source_row(requests).items()}
    assert written == expected_writes(batch, bs)
    for request in requests:
        assert request.chunk_length % bs == 0 and request.chunk_length <= policy.max_chunk_length
        assert all(request.final_chunk.start <= n - 1 < request.final_chunk.end for n in request.lengths)
        assert request.chunks[0].start <= min(min(c, n - 1) for n, c in zip(request.lengths, request.cached))
    assert from_json(tuple[PreparedPrefill, ...], to_json(prepared)) == prepared
    assert from_json(PrefillPolicy, to_json(policy)) == policy
    manifest = manifest_for(policy, layout)
    assert all(manifest.covers(p) for p in prepared)


@pytest.mark.parametrize("max_chunk", [0, -8, True, 2048.0])
def test_fine_rungs_names_a_max_chunk_that_is_not_a_positive_int(max_chunk):
    """fine_rungs(max_chunk_length=0 / -8 / True / 2048.0) is an InvalidPolicyError naming max_chunk_length."""
    with pytest.raises(InvalidPolicyError, match="max_chunk_length="):
        PrefillPolicy.fine_rungs(1, max_chunk_length=max_chunk)


@pytest.mark.parametrize(
    ("fields", "error", "field"),
    [
        ((100, 0, 0), PrefillInputError, "count"),
        ((100, -3, 0), PrefillInputError, "count"),
        ((0, 1, 0), PrefillInputError, "length"),
        ((100, 1, 200), InvalidCachedLengthError, "cached"),
        ((100, True, 0), PrefillInputError, "count"),
    ],
)
def test_a_histogram_entry_of_no_prompts_or_a_bad_length_is_refused_on_construction(fields, error, field):
    """HistogramEntry(count 0 or -3, length 0, cached past the length) is a named error, not a zero or negative cost."""
    with pytest.raises(error, match=f"HistogramEntry.{field}="):
        HistogramEntry(*fields)


@pytest.mark.parametrize(
    ("entries", "block_size", "field"),
    [
        ((), 32, "entries"),
        ([HistogramEntry(100, 1, 0)], 32, "entries"),
        ((HistogramEntry(100, 1, 0),), 0, "block_size"),
    ],
)
def test_tune_names_empty_entries_and_a_zero_block(entries, block_size, field):
    """tune((), ...) and tune(block_size=0) name the argument instead of max()'s ValueError or a ZeroDivisionError."""
    with pytest.raises(PrefillInputError, match=f"tune.{field}="):
        tune(entries, block_size=block_size, max_traces=4)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((None, PageTableLayout(32, 4, 4)), "policy"),
        ((PrefillPolicy(), None), "layout"),
        ((PrefillPolicy(), PageTableLayout(32, 4, 4), ["logits"]), "sampling_paths"),
        ((PrefillPolicy(), PageTableLayout(32, 4, 4), "logits"), "sampling_paths"),
    ],
)
def test_manifest_for_names_an_argument_of_the_wrong_kind(args, field):
    """A None policy or layout and a sampling path given as a string are named, not an AttributeError on .value."""
    with pytest.raises(PrefillInputError, match=f"manifest_for.{field}="):
        manifest_for(*args)
