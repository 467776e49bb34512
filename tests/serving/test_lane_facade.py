"""``LaneGroupFacade``: the plugin's data-parallel ``prefill_forward`` on 2 lanes x 16 slots, rows as on one lane."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from prefill_core import PrefillPolicy, SamplingPath, manifest_for
from prefill_core.values.errors import InvalidSlotError, KVCacheMismatchError, PrefillStateError, TraceCoverageError
from prefill_shell.backends import TorchBackend
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.lane_facade import LaneGroupFacade
from tests.lane_kit import changed_blocks

BLOCK, POOL, PER_LANE, MAX_SEQ = 16, 48, 16, 128
POLICY = PrefillPolicy(
    max_chunk_length=128, chunk_quantum=128, length_ladder=(128,), waves=(1, 2, 4), lane_size=PER_LANE
)
LANE_NOISE = (100, 101)
"""Seeds of each lane's pool noise: cached KV differs by lane, so a row served by the wrong lane shows."""

ROWS = [(120, 0, 17), (70, 37, 3), (100, 64, 30), (45, 0, 0), (128, 100, 16), (33, 16, 5)]
"""(prompt_lens, start_pos, empty_slot): rows of rank 0 (slots 0-15) and rank 1 (16-31) mixed, chunks unaligned."""


def _shape(model, num_blocks: int = POOL):
    spec = model.spec
    return (num_blocks, spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers


def _group(model) -> LaneGroupFacade:
    facade = LaneGroupFacade([(model, TorchBackend()), (model, TorchBackend())], max_seq_len=MAX_SEQ, policy=POLICY)
    facade.allocate_kv_cache(*_shape(model))
    return facade


def _single(model) -> ServingFacade:
    facade = ServingFacade(model, TorchBackend(), max_seq_len=MAX_SEQ, max_batch_size=PER_LANE, policy=POLICY)
    facade.allocate_kv_cache(*_shape(model))
    return facade


def _noise(kit, pools) -> None:
    for pool, seed in zip(pools, LANE_NOISE):
        kit.randomize_pool(pool, seed)


def _tensors(pool) -> list[torch.Tensor]:
    return [t.clone() for t in pool.keys + pool.values]


@pytest.fixture(scope="module")
def call(kit):
    """The plugin's tensors for ROWS; each lane hands out its own blocks from 1, so block ids repeat across lanes."""
    tokens = kit.token_matrix([kit.make_tokens(length, seed=row) for row, (length, _, _) in enumerate(ROWS)])
    table = torch.full((len(ROWS), MAX_SEQ // BLOCK), -1, dtype=torch.int32)
    next_block, written = [1, 1], {}
    for row, (length, start, slot) in enumerate(ROWS):
        lane, need = slot // PER_LANE, -(-length // BLOCK)
        table[row, :need] = torch.arange(next_block[lane], next_block[lane] + need, dtype=torch.int32)
        written[row] = set(range(next_block[lane] + start // BLOCK, next_block[lane] + need))
        next_block[lane] += need
    return SimpleNamespace(
        tokens=tokens,
        table=table,
        prompt_lens=torch.tensor([r[0] for r in ROWS]),
        start_pos=torch.tensor([r[1] for r in ROWS]),
        slots=[r[2] for r in ROWS],
        written=written,  # row -> blocks of its own lane's pool it computes (an unaligned start recomputes its block)
    )


def _forward(facade, call, rows=None, *, lane_slots=False, **kwargs):
    rows = list(range(len(ROWS))) if rows is None else rows
    slots = [call.slots[r] % PER_LANE if lane_slots else call.slots[r] for r in rows]
    return facade.prefill_forward(
        call.tokens[rows],
        call.table[rows],
        prompt_lens=call.prompt_lens[rows],
        start_pos=call.start_pos[rows],
        empty_slots=slots,
        **kwargs,
    )


def _one_lane_each(model, kit, call, sampling=None):
    """Each row alone on a one-lane facade whose pool holds its lane's noise: (outputs, that row's blocks)."""
    single = _single(model)
    outs, blocks = [], []
    for row, (_, _, slot) in enumerate(ROWS):
        kit.randomize_pool(single.kv, LANE_NOISE[slot // PER_LANE])
        extra = {} if sampling is None else {"sampling_params": sampling(row)}
        outs.append(_forward(single, call, [row], lane_slots=True, enable_trace=False, kv_cache=single.kv, **extra))
        pool = _tensors(single.kv)
        blocks.append({b: [t[b] for t in pool] for b in call.written[row]})
    return outs, blocks


@pytest.mark.parametrize("enable_trace", [False, True])
def test_dp_empty_slots_route_each_row_to_its_lane_as_one_lane_would_serve_it(tiny_model, kit, call, enable_trace):
    """Rows of both ranks mixed: logits equal a one-lane facade given that row (1e-5); KV only in its lane's blocks."""
    facade = _group(tiny_model)
    assert facade.max_batch_size == 2 * PER_LANE and len(facade.kv) == 2
    if enable_trace:
        facade.warmup_model_prefill(kv_cache=facade.kv, can_sample_on_device=False, enable_trace=True)
    _noise(kit, facade.kv)
    before = [_tensors(pool) for pool in facade.kv]
    out = _forward(facade, call, enable_trace=enable_trace, kv_cache=facade.kv)
    assert out.shape == (len(ROWS), 1, tiny_model.spec.vocab_size) and out.dtype == torch.float32
    expected, blocks = _one_lane_each(tiny_model, kit, call)
    for row, want in enumerate(expected):
        assert (out[row] - want[0]).abs().max().item() <= 1e-5, row
    after = [_tensors(pool) for pool in facade.kv]
    for lane in (0, 1):
        own = [row for row, (_, _, slot) in enumerate(ROWS) if slot // PER_LANE == lane]
        allowed = set().union(*(call.written[row] for row in own))
        assert changed_blocks(before[lane], after[lane]) <= allowed, lane
        for row in own:
            for block, want in blocks[row].items():
                got = [t[block] for t in after[lane]]
                assert all((g - w).abs().max().item() <= 1e-5 for g, w in zip(got, want)), (row, block)


def _plugin_sampling(rows):
    """Seeded plugin sampling: greedy, whole-vocab and top-k rows, a repetition penalty, log-probs asked on some."""
    table = dict(
        temperature=[0.0, 0.8, 0.9, 0.7, 1.0, 0.6],
        top_k=[1, 0, 5, -1, 20, 3],
        top_p=[0.0, 1.0, 0.9, 1.0, 0.8, 1.0],
        presence_penalty=[0.0] * 6,
        frequency_penalty=[0.0] * 6,
        repetition_penalty=[1.0, 1.0, 1.3, 1.0, 1.0, 1.3],
        seed=[-1, 11, 12, 13, 14, 15],
        num_logprobs=[0, -2, 0, 0, -2, 0],
        enable_log_probs=None,
    )
    pick = {k: v if v is None else [v[r] for r in rows] for k, v in table.items()}
    return SimpleNamespace(**pick)


def test_plugin_sampling_and_penalties_per_row_as_on_one_lane(tiny_model, kit, call):
    """(tokens, log_probs) of the group equal a one-lane facade's for each row, penalised rows included."""
    facade = _group(tiny_model)
    _noise(kit, facade.kv)
    tokens, log_probs = _forward(facade, call, enable_trace=False, sampling_params=_plugin_sampling(range(len(ROWS))))
    assert tokens.dtype == torch.int64 and tokens.shape == (len(ROWS),) and log_probs.dtype == torch.float32
    expected, _ = _one_lane_each(tiny_model, kit, call, sampling=lambda row: _plugin_sampling([row]))
    for row, (want_tokens, want_log_probs) in enumerate(expected):
        assert tokens[row].item() == want_tokens[0].item(), row
        want = 1.0 if want_log_probs is None else want_log_probs[0].item()  # 1.0 where a row asked for none
        assert abs(log_probs[row].item() - want) <= 1e-5, row


def test_allocate_returns_one_pool_per_lane_and_nothing_runs_before(tiny_model, call):
    """allocate_kv_cache returns one pool per lane, each of vLLM's shape; before it, a named state error."""
    facade = LaneGroupFacade([(tiny_model, TorchBackend()), (tiny_model, TorchBackend())], max_seq_len=MAX_SEQ)
    with pytest.raises(PrefillStateError, match="allocate_kv_cache"):
        _forward(facade, call, enable_trace=False)
    pools = facade.allocate_kv_cache(*_shape(tiny_model, num_blocks=40))
    assert len(pools) == 2 and pools[0] is not pools[1] and pools is facade.kv
    assert [runtime.config.kv for runtime in facade.runtimes] == pools
    assert all(pool.keys[0].shape[0] >= 40 for pool in pools)


@pytest.mark.parametrize(
    ("which", "named"),
    [
        ("one pool", "kv_cache=PagedKVCache is invalid"),
        ("one entry", "kv_cache holds 1 entries"),
        ("swapped", r"kv_cache\[0\] is lane 1's pool"),
        ("foreign", r"kv_cache\[1\] is a pool of no lane"),
    ],
)
def test_a_kv_cache_other_than_the_lanes_pools_in_lane_order_is_refused_by_name(tiny_model, kit, call, which, named):
    """kv_cache is one pool per lane in lane order; a single pool, a swap or a foreign pool writes nothing."""
    facade = _group(tiny_model)
    pools = facade.kv
    given = {
        "one pool": pools[0],
        "one entry": [pools[0]],
        "swapped": [pools[1], pools[0]],
        "foreign": [pools[0], tiny_model.new_kv_cache(POOL, BLOCK)],
    }[which]
    _noise(kit, pools)
    before = [_tensors(pool) for pool in pools]
    with pytest.raises(KVCacheMismatchError, match=named) as raised:
        _forward(facade, call, enable_trace=False, kv_cache=given)
    assert raised.value.field == "kv_cache"
    assert all(torch.equal(a, b) for lane in (0, 1) for a, b in zip(before[lane], _tensors(pools[lane])))


def test_a_traced_call_with_an_uncovered_lane_is_refused_before_any_lane_writes(tiny_model, kit, call):
    """Lane 0 warmed, lane 1 not: TraceCoverageError naming lane 1, and neither lane's pool changes."""
    facade = _group(tiny_model)
    lane0 = facade.runtimes[0].config
    facade.group.lanes[0].warm_up(manifest_for(lane0.policy, lane0.layout, [SamplingPath.LOGITS]))
    _noise(kit, facade.kv)
    before = [_tensors(pool) for pool in facade.kv]
    with pytest.raises(TraceCoverageError, match="lane 1"):
        _forward(facade, call, enable_trace=True, kv_cache=facade.kv)
    assert all(torch.equal(a, b) for lane in (0, 1) for a, b in zip(before[lane], _tensors(facade.kv[lane])))
    only_lane0 = [row for row, (_, _, slot) in enumerate(ROWS) if slot < PER_LANE]
    out = _forward(facade, call, only_lane0, enable_trace=True, kv_cache=facade.kv)  # lane 0 alone is covered
    assert out.shape[0] == len(only_lane0)


def test_a_slot_past_the_last_rank_is_refused_naming_the_row(tiny_model, call):
    """empty_slots beyond 2 ranks x 16 slots: InvalidSlotError naming the caller row, before any lane runs."""
    facade = _group(tiny_model)
    with pytest.raises(InvalidSlotError, match="row 1"):
        facade.prefill_forward(
            call.tokens[:2], call.table[:2], enable_trace=False, prompt_lens=call.prompt_lens[:2], empty_slots=[3, 32]
        )


def test_can_trace_answers_for_a_lane_group_as_for_one_lane(tiny_model, call):
    """can_trace on the lane facade: False before a pool exists and before a traced warm-up, then the one-lane
    answer (each lane's rows planned against that lane's captures).

    Regression: the lane facade inherited a check of the one-lane executor it never has, so it answered False
    for every call."""
    group = LaneGroupFacade([(tiny_model, TorchBackend()), (tiny_model, TorchBackend())], max_seq_len=MAX_SEQ)
    single = ServingFacade(tiny_model, TorchBackend(), max_seq_len=MAX_SEQ, max_batch_size=PER_LANE)
    args = dict(tokens=call.tokens, prompt_lens=call.prompt_lens, start_pos=call.start_pos)
    assert not group.can_trace(**args)  # nothing is allocated yet
    group.allocate_kv_cache(*_shape(tiny_model))
    single.allocate_kv_cache(*_shape(tiny_model))
    assert not single.can_trace(**args) and not group.can_trace(**args)  # nothing captured yet
    for facade in (group, single):
        facade.warmup_model_prefill(kv_cache=facade.kv, can_sample_on_device=False, enable_trace=True)
    assert single.can_trace(**args)
    assert group.can_trace(**args) == single.can_trace(**args)
    assert not group.can_trace(tokens=call.tokens[:, :0])
    group.cleanup()
    single.cleanup()
