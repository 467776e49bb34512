"""``PrefillCall`` and ``PrefillEntry``: one normalised call value, one ``prefill`` signature for every entry.

The runtime, the executor and the lane group share ``PrefillEntry.prefill``
(one signature, one normalisation); each runs a ``PrefillCall``. A lane group
now takes a windowed model's group tables like the other two (its
``prefill`` once had no ``group_page_tables``), and its rows equal
transformers on every lane.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillInputError, PrefillPolicy, WarmupManifest
from prefill_shell import LaneGroup, PrefillExecutor, PrefillRuntime
from prefill_shell.engine.call import PrefillCall, PrefillEntry
from prefill_shell.reference.windows.hybrid import HybridLlama
from tests import window_kit as kit
from tests.engine.test_windowed_runtime import _table
from tests.helpers import build_runtime

pytest.importorskip("transformers")


def test_every_entry_has_the_one_prefill_signature():
    """Runtime, executor and lane group expose PrefillEntry.prefill itself, not a copy with its own keywords."""
    for entry in (PrefillRuntime, PrefillExecutor, LaneGroup):
        assert issubclass(entry, PrefillEntry) and entry.prefill is PrefillEntry.prefill


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"mode": "fast"}, "mode"),
        ({"group_page_tables": torch.zeros(2, 2)}, "group_page_tables"),
        ({"page_table": torch.zeros(3, 2, dtype=torch.int32)}, "page_table"),
    ],
)
def test_a_call_is_normalised_once_and_bad_input_is_named(changes, field):
    """PrefillCall.of converts the matrices and parses the mode once; bad input names its field."""
    args = {"tokens": torch.ones(2, 8, dtype=torch.int64), "page_table": torch.zeros(2, 2, dtype=torch.int32)}
    call = PrefillCall.of(args["tokens"], args["page_table"], [8, 8])
    assert call.num_rows == 2 and call.mode.value == "auto" and call.tokens.dtype is torch.int64
    merged = {**args, **changes}
    extra = {k: v for k, v in merged.items() if k not in ("tokens", "page_table")}
    with pytest.raises(PrefillInputError) as raised:
        PrefillCall.of(merged["tokens"], merged["page_table"], [8, 8], **extra)
    assert raised.value.field == field


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_a_lane_group_serves_a_windowed_model_with_group_tables(mode):
    """Two lanes of a Ministral (sliding blocks of 8, full of 16): four rows routed by slot, group tables
    per row, each row equal to transformers."""
    window, lengths = 24, [70, 33, 100, 45]
    base, hf, types = kit.model_and_oracle("ministral", window)
    attention = kit.attention_of(types, window, 8)
    layout = PageTableLayout(16, 32, 200)
    policy = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2), lane_size=2)
    lanes = []
    for _ in range(2):
        model = HybridLlama(base, attention)
        lanes.append(PrefillExecutor(build_runtime(model, kv=model.new_kv_cache(200), layout=layout, policy=policy)))
    group = LaneGroup(lanes)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, base.spec.vocab_size, (n,), generator=gen) for n in lengths]
    tokens = torch.zeros(len(prompts), max(lengths), dtype=torch.int64)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    tables = [_table(t) for t in kit.fresh_tables(attention, lengths)]
    call = dict(group_page_tables=tables, null_block=0)
    slots = [0, 2, 1, 3]  # rows 0 and 2 on lane 0, rows 1 and 3 on lane 1
    if mode == "traced":
        for lane, rows in ((0, [0, 2]), (1, [1, 3])):
            runtime = lanes[lane].runtime
            lane_tables = [t[rows] for t in tables]
            batch = runtime.prepare(
                tokens[rows], lane_tables[0], [lengths[r] for r in rows], slots=[0, 1], mode=mode,
                group_page_tables=lane_tables, null_block=0,
            )  # fmt: skip
            lanes[lane].warm_up(WarmupManifest().observe(batch.requests))
    results = group.prefill(tokens, tables[0], lengths, slots=slots, mode=mode, **call)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf(prompt[None]).logits[0, -1]
        torch.testing.assert_close(results[row].logits, want, atol=kit.TOL, rtol=kit.TOL)
