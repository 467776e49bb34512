"""A warm-up's cost is decided from the manifest alone: limits keep exactly the lengths asked, costs add up."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import manifest_for
from prefill_core.calls.warmup import ModelGeometry, limited_to, programs_to_compile, warmup_cost
from prefill_core.values.errors import PrefillInputError
from tests.strategies import cases

MODEL = ModelGeometry(hidden_size=64, vocab_size=256, dtype_bytes=4, max_logprobs=3)


def _lengths(manifest) -> list[int]:
    return sorted({s.invocation_length for s in manifest.program_signatures})


@given(cases(), st.data())
def test_a_limit_keeps_exactly_the_identities_of_its_lengths(case, data):
    """limited_to keeps every program and trace of the asked lengths and nothing else."""
    manifest = manifest_for(case.policy, case.layout)
    held = _lengths(manifest)
    wanted = set(data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True)))
    limited = limited_to(manifest, wanted)
    assert set(limited.program_signatures) == {s for s in manifest.program_signatures if s.invocation_length in wanted}
    assert set(limited.trace_signatures) == {s for s in manifest.trace_signatures if s.chunk_length in wanted}


@given(cases())
def test_costs_of_disjoint_limits_add_up_to_the_whole_but_its_shared_workspaces(case):
    """Bodies and positions of a manifest are the sums over its lengths; a backend that builds nothing per
    shape runs only the smallest compile body; workspaces are shared across lengths, so bytes never exceed
    the sum."""
    manifest = manifest_for(case.policy, case.layout)
    whole = warmup_cost(manifest, MODEL)
    parts = [warmup_cost(limited_to(manifest, [length]), MODEL) for length in _lengths(manifest)]
    for field in ("compile_bodies", "compile_positions", "capture_bodies", "capture_positions"):
        assert getattr(whole, field) == sum(getattr(part, field) for part in parts)
    assert whole.persistent_bytes <= sum(part.persistent_bytes for part in parts)
    cpu = warmup_cost(manifest, MODEL, compiles_programs=False)
    smallest = min(s.padded_batch * s.invocation_length for s in manifest.program_signatures)
    assert (cpu.compile_bodies, cpu.compile_positions) == (1, smallest) and len(
        programs_to_compile(manifest, False)
    ) == 1
    assert cpu.capture_positions == whole.capture_positions and cpu.persistent_bytes == whole.persistent_bytes


def test_a_length_the_manifest_does_not_hold_is_named():
    """A typo in a warm-up limit is refused with the lengths the manifest holds, never a silently empty warm-up."""
    from prefill_core import PageTableLayout, PrefillPolicy

    manifest = manifest_for(PrefillPolicy(), PageTableLayout(32, 32, 64))
    with pytest.raises(PrefillInputError, match=r"limited_to.lengths=\[100\] is invalid: .*\[128, 1024\]"):
        limited_to(manifest, [128, 100])


def test_the_manifest_command_states_the_warm_up_cost_before_it_runs(capsys):
    """python -m prefill_core manifest prints bodies, positions and persistent bytes for a device and the CPU
    (the fine-rung bill of max_seq_len=1024, max_batch_size=8: 960 compile bodies over 1,622,016 positions)."""
    from prefill_core.__main__ import main

    assert main(["manifest", "--max-length", "1024", "--max-batch", "8", "--fine-rungs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("warm-up on a device (compiles per shape): compile 960 bodies (1622016 positions)")
    assert out[-1].startswith("warm-up on a cpu (compiles nothing): compile 1 bodies (32 positions), capture 160")
    assert out[-1].endswith(" persistent bytes")
