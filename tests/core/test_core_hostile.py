"""Odd but legal values and malformed CLI input: each plans correctly or fails with a named error."""

from __future__ import annotations

import attrs
import pytest

from prefill_core import (
    InvalidJSONError,
    InvalidLayoutError,
    InvalidPolicyError,
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    SamplingParams,
    from_json,
    manifest_for,
    prepare_prefill,
    to_json,
)
from prefill_core.__main__ import main
from prefill_core.explain import MAX_SAMPLE_BLOCKS
from prefill_core.histogram import parse_histogram
from prefill_core.tuner import tune


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
