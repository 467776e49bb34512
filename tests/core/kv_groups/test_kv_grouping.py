"""KV groups as vLLM 0.33's hybrid KV cache manager forms them, and the KV buffers its groups share.

The examples are read off vLLM's ``_get_kv_cache_groups_uniform_page_size``
(``v1/core/kv_cache_planning.py``) and issue 49's runs of it; tests/vllm
checks the same function against vLLM's own code where vLLM installs.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import (
    AttentionKind,
    AttentionLayout,
    BlockConflictError,
    InvalidLayoutError,
    KVBuffers,
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    prepare_grouped,
    vllm_layer_groups,
)

S, F = "sliding_attention", "full_attention"
GEMMA3_5TO1 = [S] * 5 + [F]


@pytest.mark.parametrize(
    ("types", "groups"),
    [
        ([F] * 4, [(0, 1, 2, 3)]),  # Llama: one spec, one group
        ([S] * 3, [(0, 1, 2)]),  # Mistral with a window on every layer
        ([F, S], [(0,), (1,)]),  # Qwen3 hybrid
        ([S, S, F], [(0,), (1,), (2,)]),  # Gemma 3 at 3 layers: three groups of one
        ([S, S, F] * 2, [(0, 3), (1, 4), (2, 5)]),  # 2:1 over 6 layers
        (GEMMA3_5TO1 * 2, [(0, 6), (1, 7), (2, 8), (3, 9), (4, 10), (5, 11)]),  # 5:1 over 12 layers
        ([S, F, S, S], [(0,), (2,), (3,), (1,)]),  # groups not in order of their first layer
        ([F] * 3 + [S] * 4, [(0, 1, 2), (3, 4, 5, 6)]),  # 4 < 1.5 x 3: the larger bucket's size, one group each
        ([F, F, S, S, S], [(0, 1), (2, 4), (3,)]),  # 3 is not under 1.5 x 2: groups of at most 2
        ([S] * 7 + [F, F], [(0, 4), (1, 5), (2, 6), (3,), (7, 8)]),  # 7 = 4 groups of at most 2
    ],
)
def test_vllm_forms_groups_of_an_equal_number_of_layers(types, groups):
    assert vllm_layer_groups(types) == tuple(groups)


@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=40))
def test_every_layer_is_in_one_group_of_one_spec_and_a_buckets_groups_differ_by_at_most_one(specs):
    groups = vllm_layer_groups(specs)
    assert sorted(layer for g in groups for layer in g) == list(range(len(specs)))
    assert all(len({specs[layer] for layer in g}) == 1 and list(g) == sorted(g) for g in groups)
    for spec in set(specs):
        sizes = [len(g) for g in groups if specs[g[0]] == spec]
        assert max(sizes) - min(sizes) <= 1
    buckets = [specs.count(s) for s in dict.fromkeys(specs)]
    assert max(len(g) for g in groups) in (min(buckets), max(buckets))


def test_vllm_grouped_keeps_each_layers_kind_window_and_block_size():
    layout = AttentionLayout.from_layer_types([S, S, F] * 2, sliding_window=24, block_size=16).vllm_grouped()
    assert layout.layer_groups == ((0, 3), (1, 4), (2, 5))
    assert [g.kind for g in layout.groups] == [AttentionKind.SLIDING, AttentionKind.SLIDING, AttentionKind.FULL]
    assert [g.window for g in layout.groups] == [24, 24, None]
    assert [layout.position_in_group(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    one_per_kind = AttentionLayout.from_layer_types([S, S, F] * 2, sliding_window=24, block_size=16)
    assert one_per_kind.regrouped(layout.layer_groups) == layout
    assert layout.layer_specs == one_per_kind.layer_specs


@pytest.mark.parametrize(
    ("groups", "field"),
    [
        ([(0, 2), (1,)], "layers"),  # a sliding and a full layer in one group
        ([(0, 3), (1,), (2,)], "layers"),  # no layer 3
        ([(0,), (), (1,), (2,)], "layers"),  # an empty group
        ([(0,), (1,)], "groups"),  # layer 2 in no group
    ],
)
def test_regrouping_into_groups_that_mix_specs_or_miss_layers_is_a_named_error(groups, field):
    layout = AttentionLayout.from_layer_types([S, S, F], sliding_window=24, block_size=16)
    with pytest.raises(InvalidLayoutError) as raised:
        layout.regrouped(groups)
    assert raised.value.field == field


# ---------------------------------------------------------------- shared buffers


@given(st.lists(st.sampled_from([S, F]), min_size=1, max_size=30))
def test_vllms_plan_shares_one_buffer_per_position_in_a_group(types):
    layout = AttentionLayout.from_layer_types(types, sliding_window=8, block_size=16).vllm_grouped()
    buffers = KVBuffers.shared(layout)
    assert buffers.num_buffers == max(len(g.layers) for g in layout.groups)
    for buffer in range(buffers.num_buffers):
        held = buffers.layers_of(buffer)
        assert len({layout.group_of(layer) for layer in held}) == len(held)  # one layer per group at most


def test_groups_of_different_block_sizes_get_a_buffer_per_layer():
    layout = AttentionLayout.from_layer_types(
        [S, F, S], sliding_window=8, block_size=16, sliding_block_size=8
    ).vllm_grouped()
    assert KVBuffers.shared(layout).buffer_of == (0, 1, 2)


@pytest.mark.parametrize(
    ("block_sizes", "indices", "field", "words"),
    [
        ((16, 16), (0, 0, 0, 1, 1, 1, 9), "buffer_of", "one buffer index per layer"),
        ((16, 16), (0, 0, 0, 1, 1, -1), "buffer_of[5]", "int >= 0"),
        ((16, 16), (0, 0, 0, 2, 2, 2), "buffer_of", "0..n-1"),
        ((16, 16), (0, 0, 0, 0, 1, 1), "buffer_of[3]", "both in KV group 0"),
        ((8, 16), (0, 0, 0, 1, 1, 1), "buffer_of[2]", "share a block size"),
    ],
)
def test_a_buffer_assignment_that_would_overlay_two_pages_is_a_named_error(block_sizes, indices, field, words):
    sliding, full = block_sizes
    layout = AttentionLayout.from_layer_types(
        [S, S, F] * 2, sliding_window=24, block_size=full, sliding_block_size=sliding
    ).vllm_grouped()
    with pytest.raises(InvalidLayoutError, match=words) as raised:
        KVBuffers(layout, indices)
    assert raised.value.field == field


def test_a_block_kept_in_two_groups_is_refused_before_planning():
    """vLLM gives a block to one group at a time; groups share buffers, so a block named in two is refused,
    read as well as written (a cached block read in group 0 is one layer's page, read in group 1 another's)."""
    layout = AttentionLayout.from_layer_types([S, S, F], sliding_window=24, block_size=16).vllm_grouped()
    policy = PrefillPolicy(length_ladder=(64,), max_chunk_length=64, chunk_quantum=64)
    pages = PageTableLayout(16, 8, 64)
    batch = PrefillBatch((40,), (32,), (0,), ((1, 2, 3),), (None,))
    prepare_grouped(batch, policy, pages, layout, (((1, 2, 3),), ((4, 5, 6),), ((7, 8, 9),)), null_block=0)
    read_twice = ((1, 2, 3),), ((4, 1, 6),), ((7, 8, 9),)  # cached block 1 in group 0 and in group 1
    with pytest.raises(BlockConflictError, match="one block-id space") as raised:
        prepare_grouped(batch, policy, pages, layout, read_twice, null_block=0)
    assert raised.value.row == 0 and raised.value.field == "group_blocks[1][1]"
    written_twice = ((1, 2, 3),), ((4, 5, 3),), ((7, 8, 9),)
    with pytest.raises(BlockConflictError, match="one writer"):
        prepare_grouped(batch, policy, pages, layout, written_twice, null_block=0)
