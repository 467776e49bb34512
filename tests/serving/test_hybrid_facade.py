"""The serving facade for a hybrid model, called as vLLM's Tenstorrent plugin calls it.

``allocate_kv_cache_per_layer`` with one spec per layer (the sliding group at
block size 8, the full group at 16, one block-id space), then
``prefill_forward`` with ``page_tables_per_layer`` as the plugin sends it:
one table per layer, padded to ``max_num_seqs`` rows in fresh tensors, the
sliding layers' tables holding vLLM's null block 0 (NaN here) and the other
row's ids before the window. Eager and traced (after
``warmup_model_prefill``) equal transformers' Ministral within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PrefillConfigError, PrefillInputError
from prefill_shell.backends.torch_backend import TorchBackend
from prefill_shell.reference.windows.hybrid import HybridLlama
from prefill_shell.serving.hybrid_facade import HybridServingFacade
from tests import window_kit as kit

pytest.importorskip("transformers")

LENGTHS, CACHED = (tuple(n for n, _ in kit.ROWS), tuple(c for _, c in kit.ROWS))

WINDOW = 24
SEQS = 4
NUM_BLOCKS = 200


def _facade():
    base, hf, types = kit.model_and_oracle("ministral", WINDOW)
    attention = kit.attention_of(types, WINDOW, 8)
    model = HybridLlama(base, attention)
    facade = HybridServingFacade(model, TorchBackend(), max_seq_len=256, max_batch_size=SEQS, policy=kit.POLICY)
    return facade, model, attention, hf


def _specs(model, attention, block_sizes=None):
    spec = model.spec
    out = []
    for layer in range(spec.num_layers):
        bs = attention.groups[attention.group_of(layer)].block_size if block_sizes is None else block_sizes[layer]
        out.append(((NUM_BLOCKS, spec.num_kv_heads, bs, spec.head_dim), model.dtype, layer))
    return out


def _per_layer(attention, rows_per_group):
    """The plugin's ``page_tables_per_layer``: a fresh ``[max_num_seqs, width]`` tensor per layer, -1 padded."""
    tables = [None] * attention.num_layers
    for group, rows in zip(attention.groups, rows_per_group):
        width = max(len(r) for r in rows)
        for layer in group.layers:
            table = torch.full((SEQS, width), -1, dtype=torch.int32)
            for i, row in enumerate(rows):
                table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
            tables[layer] = table
    return tables


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager", "traced"])
def test_prefill_forward_with_page_tables_per_layer_equals_transformers(enable_trace):
    """Two plugin steps over freed blocks (null and the other row's ids outside the window) equal transformers."""
    facade, model, attention, hf = _facade()
    kv = facade.allocate_kv_cache_per_layer(_specs(model, attention))
    attention = facade.model.attention  # vLLM's groups: sliding [0], sliding [2], full [1]
    assert attention.layer_groups == ((0,), (2,), (1,))
    for pool in kv.pools:
        for tensor in pool.keys + pool.values:
            tensor[kit.NULL] = float("nan")
    facade.warmup_model_prefill(kv_cache=kv, can_sample_on_device=False, enable_trace=enable_trace)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.spec.vocab_size, (n,), generator=gen) for n in LENGTHS]
    tokens = torch.zeros(2, max(LENGTHS), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    tables = kit.fresh_tables(attention, LENGTHS)
    steps = [(list(CACHED), [0, 0], tables)]
    rows = [
        kit.free_left_window(kv, attention, [t[0] for t in tables], [t[1] for t in tables], CACHED[0], "null"),
        kit.free_left_window(kv, attention, [t[1] for t in tables], [t[0] for t in tables], CACHED[1], "other"),
    ]
    steps.append((list(LENGTHS), list(CACHED), tuple(tuple(r[g] for r in rows) for g in range(len(attention.groups)))))
    null_bytes = kv.block_bytes(kit.NULL)
    for ends, starts, step_tables in steps:
        per_layer = _per_layer(attention, step_tables)
        logits = facade.prefill_forward(
            tokens,
            per_layer[0][:2],  # the plain page_table: group 0's table of the call's rows
            enable_trace=enable_trace,
            prompt_lens=torch.tensor(ends),
            start_pos=torch.tensor(starts),
            kv_cache=kv,
            page_tables_per_layer=per_layer,
        )
        assert torch.equal(kv.block_bytes(kit.NULL), null_bytes)
    for row, prompt in enumerate(prompts):
        expected, _ = kit.hf_logits_and_kv(hf, prompt)
        assert torch.allclose(logits[row, 0], expected, rtol=kit.TOL, atol=kit.TOL), (
            row,
            (logits[row, 0] - expected).abs().max(),
        )
    facade.cleanup()


def test_per_layer_specs_and_tables_are_checked_by_name():
    """A layer's spec at another head count or dtype, tensor indices that overlay one group's layers, and a
    group's layers with different tables, are named; nothing is allocated by a refused spec."""
    facade, model, attention, _ = _facade()
    specs = _specs(model, attention)
    heads = list(specs)
    heads[1] = ((NUM_BLOCKS, model.spec.num_kv_heads + 1, 16, model.spec.head_dim), model.dtype, 1)
    with pytest.raises(PrefillConfigError, match=r"per_layer_specs\[1\]"):
        facade.allocate_kv_cache_per_layer(heads)
    dtype = list(specs)
    dtype[2] = (specs[2][0], torch.float16, 2)
    with pytest.raises(PrefillConfigError, match=r"per_layer_specs\[2\]"):
        facade.allocate_kv_cache_per_layer(dtype)
    with pytest.raises(PrefillConfigError, match="give every layer one"):
        facade.allocate_kv_cache_per_layer([specs[0], specs[1], specs[2][:2]])
    overlaid = [specs[0], specs[1], (specs[2][0], specs[2][1], 0)]  # layers 0 and 2 (one group) in buffer 0
    with pytest.raises(PrefillConfigError, match="a group's layers need a buffer each"):
        facade.allocate_kv_cache_per_layer(overlaid, layer_groups=[[0, 2], [1]])
    with pytest.raises(PrefillConfigError, match="layer_groups"):
        facade.allocate_kv_cache_per_layer(specs, layer_groups=[[0, 1], [2]])  # a sliding and a full layer
    assert facade.kv is None
    kv = facade.allocate_kv_cache_per_layer([(shape, dtype) for shape, dtype, _ in specs], layer_groups=[[0, 2], [1]])
    attention = facade.model.attention
    # Groups of block sizes 8 and 16 hold pages of two shapes: no buffer is shared (vLLM never shares them).
    assert attention.layer_groups == ((0, 2), (1,)) and kv.buffers.buffer_of == (0, 1, 2)
    tables = kit.fresh_tables(attention, (40,))
    per_layer = _per_layer(attention, tables)
    per_layer[2] = per_layer[2].clone()
    per_layer[2][0, 0] = 199  # layer 2 is in layer 0's group: its table must hold the same rows
    tokens = torch.ones(1, 40, dtype=torch.int64)
    with pytest.raises(PrefillInputError, match=r"page_tables_per_layer\[2\]"):
        facade.prefill_forward(
            tokens, per_layer[0][:1], enable_trace=False, kv_cache=kv, page_tables_per_layer=per_layer
        )
    with pytest.raises(PrefillInputError, match="page_tables_per_layer"):
        facade.prefill_forward(tokens, per_layer[0][:1], enable_trace=False, kv_cache=kv)
    facade.cleanup()


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager", "traced"])
def test_one_sliding_group_takes_page_table_alone_as_the_plugin_sends_it(enable_trace):
    """Mistral with a window on every layer is one KV group (vLLM's ``SlidingWindowSpec``): the plugin sends
    no ``page_tables_per_layer``, and ``page_table`` (null block 0 below the window) is that group's table."""
    base, hf, types = kit.model_and_oracle("mistral", WINDOW)
    model = HybridLlama(base, kit.attention_of(types, WINDOW, 16))
    facade = HybridServingFacade(model, TorchBackend(), max_seq_len=256, max_batch_size=SEQS, policy=kit.POLICY)
    kv = facade.allocate_kv_cache_per_layer(_specs(model, model.attention))
    assert facade.model.attention.layer_groups == ((0, 1),) and kv.buffers.num_buffers == 2
    kit.nan_fill(kv, [[kit.NULL]])
    facade.warmup_model_prefill(kv_cache=kv, can_sample_on_device=False, enable_trace=enable_trace)
    prompt = torch.randint(0, model.spec.vocab_size, (150,), generator=torch.Generator().manual_seed(3))
    row = list(range(1, 11))
    facade.prefill_forward(
        prompt[None, :70],
        torch.tensor([row]),
        enable_trace=enable_trace,
        prompt_lens=torch.tensor([70]),
        start_pos=torch.tensor([0]),
        kv_cache=kv,
    )
    freed = kit.free_left_window(kv, facade.model.attention, [row], [row], 70, "null")  # blocks before the window
    table = torch.full((1, 16), kit.NULL, dtype=torch.int32)
    table[0, :10] = torch.tensor(freed[0])
    logits = facade.prefill_forward(
        prompt[None],
        table,
        enable_trace=enable_trace,
        prompt_lens=torch.tensor([150]),
        start_pos=torch.tensor([70]),
        kv_cache=kv,
    )
    expected, _ = kit.hf_logits_and_kv(hf, prompt)
    assert torch.allclose(logits[0, 0], expected, rtol=kit.TOL, atol=kit.TOL), (logits[0, 0] - expected).abs().max()
    facade.cleanup()


@pytest.mark.parametrize(
    "types",
    [
        ("full_attention", "sliding_attention"),  # Qwen3 hybrid: 2 groups of 1, 1 buffer
        ("sliding_attention", "sliding_attention", "full_attention") * 2,  # Gemma 3 at 2:1: 3 groups of 2
        (("sliding_attention",) * 5 + ("full_attention",)) * 2,  # Gemma 3 at 5:1: 6 groups of 2
        ("sliding_attention",) * 7 + ("full_attention",) * 2,  # 4 sliding groups (2, 2, 2, 1), 1 full
    ],
    ids=["qwen3", "gemma3-2to1", "gemma3-5to1", "uneven"],
)
def test_the_pool_holds_the_kv_bytes_vllm_planned_and_layers_of_a_buffer_share_its_pages(types):
    """vLLM plans ``num_blocks`` pages per KV tensor, one tensor per position in a group (the largest group's
    size): the pool allocates exactly that, and layer i of every group is a view of buffer i."""
    from prefill_shell.reference import random_llama

    base = random_llama(1, "tiny", num_layers=len(types))
    model = HybridLlama(base, kit.attention_of(types, WINDOW, 16))
    facade = HybridServingFacade(model, TorchBackend(), max_seq_len=256, max_batch_size=SEQS, policy=kit.POLICY)
    spec = model.spec
    kv = facade.allocate_kv_cache_per_layer(
        [((NUM_BLOCKS, spec.num_kv_heads, 16, spec.head_dim), model.dtype)] * len(types)
    )
    attention = facade.model.attention
    tensors = max(len(g.layers) for g in attention.groups)
    page = 2 * 16 * spec.num_kv_heads * spec.head_dim * model.dtype.itemsize  # K and V of one block of one layer
    assert kv.allocated_bytes() == NUM_BLOCKS * page * tensors
    assert len(attention.groups) > 1
    for layer in range(spec.num_layers):
        pool, local, _, _ = kv.of_layer(layer)
        assert pool.keys[local].data_ptr() == kv.keys[attention.position_in_group(layer)].data_ptr()
    facade.cleanup()


def test_one_entry_serves_a_model_with_kv_groups_and_one_without():
    """``serving_facade`` picks the hybrid facade exactly when the model has an attention layout."""
    from prefill_shell.reference import random_llama
    from prefill_shell.serving import ServingFacade, serving_facade

    base, _, types = kit.model_and_oracle("mistral", WINDOW)
    hybrid = serving_facade(HybridLlama(base, kit.attention_of(types, WINDOW, 16)), TorchBackend(), max_seq_len=64)
    plain = serving_facade(random_llama(0, "tiny"), TorchBackend(), max_seq_len=64)
    assert type(hybrid) is HybridServingFacade and type(plain) is ServingFacade


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager", "traced"])
def test_a_windowed_model_on_two_lanes_through_serving_facade_equals_transformers(enable_trace):
    """serving_facade(lanes=...) of a windowed model is the KV-group facade over a lane group: every lane
    regrouped as vLLM groups it, its pool in vLLM's buffers; rows routed by empty_slots (rank * seqs + i), each
    lane's page_tables_per_layer in its own pool's ids; every row equals transformers."""
    from prefill_shell.serving import HybridLaneGroupFacade, serving_facade

    base, hf, types = kit.model_and_oracle("ministral", WINDOW)
    attention = kit.attention_of(types, WINDOW, 8)
    model = HybridLlama(base, attention)
    facade = serving_facade(
        lanes=[(model, TorchBackend()), (model, TorchBackend())], max_seq_len=256, policy=kit.POLICY
    )
    assert isinstance(facade, HybridLaneGroupFacade) and facade.num_lanes == 2
    pools = facade.allocate_kv_cache_per_layer(_specs(model, attention))
    regrouped = facade.model.attention
    assert regrouped.layer_groups == ((0,), (2,), (1,))
    assert all(runtime.config.model.attention == regrouped for runtime in facade.runtimes)
    facade.warmup_model_prefill(kv_cache=pools, can_sample_on_device=False, enable_trace=enable_trace)
    gen = torch.Generator().manual_seed(12)
    lengths = [70, 101, 45, 130]
    prompts = [torch.randint(0, model.spec.vocab_size, (n,), generator=gen) for n in lengths]
    tokens = torch.zeros(len(prompts), max(lengths), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    seqs = kit.POLICY.lane_size
    empty_slots = [0, seqs, 1, seqs + 1]  # rows 0, 2 on lane 0; rows 1, 3 on lane 1
    tables = kit.fresh_tables(regrouped, lengths)  # ids distinct across rows, so valid in either lane's pool
    per_layer = _per_layer(regrouped, tables)
    logits = facade.prefill_forward(
        tokens,
        per_layer[0][: len(prompts)],
        enable_trace=enable_trace,
        prompt_lens=torch.tensor(lengths),
        start_pos=torch.zeros(len(prompts), dtype=torch.int64),
        empty_slots=empty_slots,
        kv_cache=pools,
        page_tables_per_layer=per_layer,
    )
    for row, prompt in enumerate(prompts):
        expected, _ = kit.hf_logits_and_kv(hf, prompt)
        assert torch.allclose(logits[row, 0], expected, rtol=kit.TOL, atol=kit.TOL), row
    facade.cleanup()
