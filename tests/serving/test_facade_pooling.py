"""``prefill_forward(..., pooling=)``: pooling requests through the plugin's facade, on every facade variant.

The return is vLLM's ``pooler_output``: per row, the pooler head's output once the step completes the row's prompt,
else None. Oracles: each row's final hidden states from one unchunked forward of the same model
(``forward_hidden``), with the heads written out here as vLLM's pooler applies them (truncate, then normalise;
the score linear, then the activation); ``SentenceTransformer.encode`` on a folder it wrote; transformers'
Ministral for a model with sliding-window KV groups. Every refusal is named (row, field, value, rule) and leaves
the KV pool byte-identical.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_core.values.errors import PrefillConfigError
from prefill_core.values.pooling import (
    ClassifyActivation,
    InvalidPoolingError,
    PoolerConfig,
    PoolingParams,
    PoolingPrefixError,
    PoolingType,
)
from prefill_shell.backends import TorchBackend
from prefill_shell.reference import random_llama
from prefill_shell.serving import HybridLaneGroupFacade, HybridServingFacade, LaneGroupFacade, serving_facade
from tests.helpers import assign_blocks, page_table, randomize_pool
from tests.pooling.test_collector import _one_pass

BLOCK = 16
POLICY = PrefillPolicy(max_chunk_length=64, chunk_quantum=64, length_ladder=(32, 64), waves=(1, 2, 4))
TOL = 1e-5
LENGTHS = [120, 70, 33, 50]  # the first two run past one 64-token chunk
LABELS = 3


@pytest.fixture(scope="module")
def model():
    return random_llama(4, "tiny")


@pytest.fixture(scope="module")
def score(model):
    return torch.randn(LABELS, model.spec.hidden_size, generator=torch.Generator().manual_seed(5))


def _pooler(model, kind: PoolingType, *, head: bool = True, **fields) -> PoolerConfig:
    extra = dict(num_labels=LABELS, activation=ClassifyActivation.SOFTMAX) if head else {}
    return PoolerConfig(hidden_size=model.spec.hidden_size, pooling_type=kind, **extra, **fields)


def _facade(model, score=None, **kwargs):
    facade = serving_facade(
        model, TorchBackend(), max_seq_len=256, max_batch_size=4, policy=POLICY, score=score, **kwargs
    )
    spec = model.spec
    facade.allocate_kv_cache((48, spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers)
    return facade


def _call(lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 256, (len(lengths), max(lengths)), generator=gen)
    table = page_table(assign_blocks(lengths, BLOCK, 48, seed=seed + 1))
    return tokens, table


def _expected(model, prompt: torch.Tensor, kind: PoolingType, params: PoolingParams, score, normalize_default=True):
    """vLLM's pooler output of one row, from one unchunked forward: pool, then the task's head."""
    hidden = _one_pass(model, prompt.tolist())
    pooled = {PoolingType.LAST: hidden[-1], PoolingType.MEAN: hidden.mean(0), PoolingType.CLS: hidden[0]}[kind]
    if params.task == "classify":
        logits = score @ pooled
        return logits if params.use_activation is False else logits.softmax(-1)
    vector = pooled if params.dimensions is None else pooled[: params.dimensions]
    normalize = normalize_default if params.normalize is None else params.normalize
    return vector / vector.norm() if normalize else vector


def _close(got, want, tol=TOL) -> None:
    assert got is not None and got.shape == want.shape and got.dtype == torch.float32, (got, want.shape)
    assert torch.allclose(got, want, rtol=tol, atol=tol), (got - want).abs().max()


def _pool_bytes(kv) -> list[torch.Tensor]:
    """Every KV tensor of a pool, of each group's pool (KV groups), of each lane's pool (a lane group)."""
    out = []
    for pool in kv if isinstance(kv, (list, tuple)) else [kv]:
        for part in getattr(pool, "pools", [pool]):
            out += [t.clone() for t in part.keys + part.values]
    return out


ROW_PARAMS = [
    PoolingParams.embed(),  # the pooler's default: normalised
    PoolingParams.embed(dimensions=16, normalize=False),  # Matryoshka truncation, raw
    PoolingParams.classify(),  # softmax over the three labels
    PoolingParams.classify(use_activation=False),  # the raw logits
]


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("kind", list(PoolingType))
def test_each_row_is_its_one_pass_vector_under_vllms_head(model, score, kind, enable_trace):
    """Embed and classify rows mixed in one call (vLLM's dispatch pooler groups them by task), rows past one chunk
    (MEAN sums across the runtime's chunks): each output equals one unchunked pass pooled and headed."""
    facade = _facade(model, score, pooler=_pooler(model, kind, matryoshka=True))
    if enable_trace:
        facade.warmup_model_prefill(kv_cache=facade.kv, can_sample_on_device=False, enable_trace=True)
    tokens, table = _call()
    out = facade.prefill_forward(
        tokens, table, enable_trace=enable_trace, prompt_lens=torch.tensor(LENGTHS), kv_cache=facade.kv,
        empty_slots=[3, 0, 2, 1], pooling=ROW_PARAMS,
    )  # fmt: skip
    assert isinstance(out, list) and len(out) == len(LENGTHS)
    for row, params in enumerate(ROW_PARAMS):
        _close(out[row], _expected(model, tokens[row, : LENGTHS[row]], kind, params, score))
    assert out[1].shape == (16,) and out[2].shape == (LABELS,)
    backend = facade.runtime.backend
    if enable_trace:
        assert sum(trace.replays for trace in facade.runtime.captured_traces()) > 0
    else:
        assert backend.ledger.live() == []  # nothing of the call outlives it
    facade.cleanup()
    assert backend.ledger.live() == []


def test_without_pooling_a_pooling_facade_returns_todays_logits_and_tokens(model, score):
    """``pooling=None`` is exactly the call without the argument: logits ``[B, 1, V]`` equal a facade built
    without a pooler, and sampled ``(tokens, log_probs)`` too."""
    tokens, table = _call()
    plain, pooling = _facade(model), _facade(model, score, pooler=_pooler(model, PoolingType.LAST))
    args = dict(enable_trace=False, prompt_lens=torch.tensor(LENGTHS))
    logits = pooling.prefill_forward(tokens, table, pooling=None, **args)
    assert torch.equal(logits, plain.prefill_forward(tokens, table, **args))
    assert logits.shape == (len(LENGTHS), 1, model.spec.vocab_size)
    greedy = _plugin_sampling(len(LENGTHS))
    sampled, log_probs = pooling.prefill_forward(tokens, table, sampling_params=greedy, **args)
    assert torch.equal(sampled, logits[:, 0].argmax(-1)) and log_probs is None


def test_last_pooling_across_vllm_steps_and_from_a_cached_prefix(model, score):
    """As vLLM schedules a LAST model: a prompt chunked over two steps is None on its partial step and its vector
    on the step that completes it (``pooling_prompt_lens`` says which); a row that maps another row's first
    three blocks as cached (``start_pos`` 48) computes only its tail and still pools its whole prompt's last
    position. All three equal one unchunked pass."""
    facade = _facade(model, score, pooler=_pooler(model, PoolingType.LAST))
    tokens, table = _call([120, 70])
    shared = torch.cat((tokens[0, :48], torch.randint(1, 256, (40,), generator=torch.Generator().manual_seed(9))))
    params = [PoolingParams.embed(normalize=False), PoolingParams.classify()]
    step1 = facade.prefill_forward(
        tokens, table, enable_trace=False, prompt_lens=torch.tensor([48, 70]), start_pos=torch.tensor([0, 0]),
        pooling=params, pooling_prompt_lens=[120, 70],
    )  # fmt: skip
    assert step1[0] is None
    _close(step1[1], _expected(model, tokens[1, :70], PoolingType.LAST, params[1], score))
    rows = torch.zeros(2, 120, dtype=torch.int64)
    rows[0], rows[1, :88] = tokens[0], shared
    free = sorted(set(range(1, 48)) - set(table[table >= 0].tolist()))
    tail = table[0, :3].tolist() + free[:3]  # row 0's first three blocks (48 tokens) cached, then its own
    step2 = facade.prefill_forward(
        rows, page_table([table[0].tolist(), tail]), enable_trace=False, prompt_lens=torch.tensor([120, 88]),
        start_pos=torch.tensor([48, 48]), pooling=[params[0], PoolingParams.embed()], pooling_prompt_lens=[120, 88],
    )  # fmt: skip
    _close(step2[0], _expected(model, tokens[0, :120], PoolingType.LAST, params[0], score))
    _close(step2[1], _expected(model, shared, PoolingType.LAST, PoolingParams.embed(), score))


def _plugin_sampling(rows: int):
    """TTSamplingParams as the plugin fills it for greedy rows without log-probs."""
    return SimpleNamespace(
        temperature=[0.0] * rows, top_k=[1] * rows, top_p=[0.0] * rows, presence_penalty=[0.0] * rows,
        frequency_penalty=[0.0] * rows, repetition_penalty=[1.0] * rows, seed=[-1] * rows, num_logprobs=[-2] * rows,
        enable_log_probs=None,
    )  # fmt: skip


# (facade: "plain" no pooler, "mean" a MEAN pooler without head or Matryoshka, "last" LAST with a head), the call's
# changes, the error class, and what its message must say.
REFUSALS = {
    "no pooler": ("plain", dict(pooling=[PoolingParams.embed(), None]), InvalidPoolingError, "has no pooler"),
    "not a list": ("mean", dict(pooling="embed"), InvalidPoolingError, "one PoolingParams or None per row"),
    "wrong length": ("mean", dict(pooling=[PoolingParams.embed()]), InvalidPoolingError, "1 entries for 2 rows"),
    "not PoolingParams": ("mean", dict(pooling=[None, PoolingType.MEAN]), InvalidPoolingError, "row 1: pooling="),
    "no head": (
        "mean",
        dict(pooling=[PoolingParams.embed(), PoolingParams.classify()]),
        InvalidPoolingError,
        "row 1: task='classify' is invalid: the model has no classification head",
    ),
    "token-wise": (
        "mean",
        dict(pooling=[PoolingParams("token_embed"), None]),
        InvalidPoolingError,
        "row 0: task='token_embed' is invalid: token-wise pooling",
    ),
    "no Matryoshka": (
        "mean",
        dict(pooling=[PoolingParams.embed(dimensions=8), None]),
        InvalidPoolingError,
        "row 0: dimensions=8 is invalid: the model does not declare Matryoshka",
    ),
    "embed field on classify": (
        "last",
        dict(pooling=[PoolingParams.classify(), PoolingParams("classify", dimensions=8)]),
        InvalidPoolingError,
        "row 1: dimensions=8 is invalid: an embed field",
    ),
    "classify field on embed": (
        "last",
        dict(pooling=[PoolingParams("embed", use_activation=True), None]),
        InvalidPoolingError,
        "row 0: use_activation=True is invalid: a classify field",
    ),
    "sampled and pooled": (
        "mean",
        dict(pooling=[None, PoolingParams.embed()], sampling_params=_plugin_sampling(2)),
        InvalidPoolingError,
        "row 1: sampling_params with pooling is invalid: a row is sampled or pooled, not both",
    ),
    "MEAN partial prefill": (
        "mean",
        dict(pooling=[PoolingParams.embed()] * 2, pooling_prompt_lens=[120, 70]),
        PoolingPrefixError,
        r"row 0: prompt_lens=100 is invalid: MEAN pooling needs the whole prompt \(120 tokens\) in one step",
    ),
    "MEAN past position 0": (
        "mean",
        dict(pooling=[None, PoolingParams.embed()], start_pos=torch.tensor([0, 32])),
        PoolingPrefixError,
        "row 1: start_pos=32 is invalid: MEAN pooling reads every position from 0",
    ),
    "whole prompt shorter": (
        "last",
        dict(pooling=[None, PoolingParams.embed()], pooling_prompt_lens=[100, 60]),
        InvalidPoolingError,
        "row 1: pooling_prompt_lens=60 is invalid: at least prompt_lens=70",
    ),
    "whole prompts without pooling": (
        "last",
        dict(pooling_prompt_lens=[100, 70]),
        InvalidPoolingError,
        "pooling_prompt_lens is invalid without pooling",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_pooling_call_is_named_and_leaves_the_pool_byte_identical(model, score, case):
    which, changes, error, message = REFUSALS[case]
    pooler = {
        "plain": None,
        "mean": _pooler(model, PoolingType.MEAN, head=False),
        "last": _pooler(model, PoolingType.LAST),
    }[which]
    facade = _facade(model, score if which == "last" else None, pooler=pooler)
    tokens, table = _call([120, 70])
    randomize_pool(facade.kv, seed=3)
    before = _pool_bytes(facade.kv)
    args = dict(enable_trace=False, prompt_lens=torch.tensor([100, 70]), start_pos=torch.tensor([0, 0]))
    with pytest.raises(error, match=message):
        facade.prefill_forward(tokens, table, kv_cache=facade.kv, **(args | changes))
    after = _pool_bytes(facade.kv)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert facade.runtime.backend.ledger.live() == []


def test_a_facade_whose_pooler_does_not_fit_is_refused_when_built(model, score):
    """The pooler and head are checked against the model and backend before any pool exists."""
    hidden = model.spec.hidden_size
    built = dict(max_seq_len=256, max_batch_size=4, policy=POLICY)
    cases = [
        (dict(score=score), "score= is invalid without pooler="),
        (dict(pooler=PoolerConfig(hidden_size=hidden + 1)), f"pooler.hidden_size={hidden + 1} is invalid"),
        (dict(pooler=_pooler(model, PoolingType.LAST)), "score= and pooler.num_labels=3 come together"),
        (dict(pooler=_pooler(model, PoolingType.LAST), score=score[:2]), r"score of shape \(2, 64\) is invalid"),
        (dict(pooler="LAST"), "pooler=str is invalid: a PoolerConfig or None"),
    ]
    for kwargs, message in cases:
        with pytest.raises(PrefillConfigError, match=message):
            serving_facade(model, TorchBackend(), **built, **kwargs)
    with pytest.raises(PrefillConfigError, match="lane 0's SimpleNamespace: pooling reads .* torch tensors"):
        serving_facade(model, SimpleNamespace(), **built, pooler=PoolerConfig(hidden_size=hidden))


def test_a_lane_group_pools_each_lanes_rows_as_one_lane_does(model, score):
    """``serving_facade(lanes=...)``: rows routed to two lanes by ``empty_slots``, each pooled and headed as a
    one-lane facade pools it (equal to one pass)."""
    pooler = _pooler(model, PoolingType.MEAN, matryoshka=True)
    group = serving_facade(
        lanes=[(model, TorchBackend()), (model, TorchBackend())], max_seq_len=256, score=score, pooler=pooler,
        policy=PrefillPolicy(max_chunk_length=64, chunk_quantum=64, length_ladder=(32, 64), lane_size=2),
    )  # fmt: skip
    assert isinstance(group, LaneGroupFacade)
    spec = model.spec
    pools = group.allocate_kv_cache((48, spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers)
    tokens, table = _call()
    out = group.prefill_forward(
        tokens, table, enable_trace=False, prompt_lens=torch.tensor(LENGTHS), kv_cache=pools,
        empty_slots=[3, 0, 2, 1], pooling=ROW_PARAMS,
    )  # fmt: skip
    for row, params in enumerate(ROW_PARAMS):
        _close(out[row], _expected(model, tokens[row, : LENGTHS[row]], PoolingType.MEAN, params, score))
    assert all(executor.runtime.backend.ledger.live() == [] for executor in group.lanes.executors())


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("kind", [PoolingType.MEAN, PoolingType.LAST])
def test_a_model_in_kv_groups_pools_as_transformers_computes_it(kind, lanes):
    """Sliding-window layers in their own KV groups (vLLM's per-layer specs and tables, block sizes 8 and 16):
    ``serving_facade`` picks the KV-group facade, one lane or two, and each row's pooled vector equals the mean or
    last of transformers' Ministral final hidden states (within 1e-4, as its logits are checked)."""
    from prefill_shell.reference.windows.hybrid import HybridLlama
    from tests import window_kit as kit
    from tests.serving.test_hybrid_facade import _per_layer, _specs

    base, hf, types = kit.model_and_oracle("ministral", 24)
    model = HybridLlama(base, kit.attention_of(types, 24, 8))
    pooler = _pooler(model, kind, head=False, normalize=False)
    if lanes == 1:
        facade = serving_facade(
            model, TorchBackend(), max_seq_len=256, max_batch_size=4, policy=kit.POLICY, pooler=pooler
        )
        assert isinstance(facade, HybridServingFacade)
    else:
        pairs = [(model, TorchBackend()), (model, TorchBackend())]
        facade = serving_facade(lanes=pairs, max_seq_len=256, policy=kit.POLICY, pooler=pooler)
        assert isinstance(facade, HybridLaneGroupFacade)
    kv = facade.allocate_kv_cache_per_layer(_specs(model, model.attention))
    attention = facade.model.attention
    lengths = [150, 101]
    gen = torch.Generator().manual_seed(2)
    tokens = torch.zeros(2, 150, dtype=torch.int64)
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.randint(0, model.spec.vocab_size, (n,), generator=gen)
    per_layer = _per_layer(attention, kit.fresh_tables(attention, lengths))
    out = facade.prefill_forward(
        tokens, per_layer[0][:2], enable_trace=False, prompt_lens=torch.tensor(lengths), kv_cache=kv,
        empty_slots=[0, 3] if lanes == 1 else [5, 0], page_tables_per_layer=per_layer,
        pooling=[PoolingParams.embed()] * 2,
    )  # fmt: skip
    for row, n in enumerate(lengths):
        with torch.no_grad():
            hidden = hf.model(tokens[row : row + 1, :n]).last_hidden_state[0]
        _close(out[row], hidden.mean(0) if kind is PoolingType.MEAN else hidden[-1], tol=1e-4)
    facade.cleanup()


def test_a_sentence_transformers_folder_served_through_the_facade_equals_encode(tmp_path):
    """A MEAN sentence-transformers folder with a Normalize module, loaded by ``load_pooling_folder`` into the
    facade (``pooler=``, ``score=``): each embedding equals ``SentenceTransformer.encode`` within 1e-5."""
    pytest.importorskip("sentence_transformers")
    from prefill_shell.reference.loading.pooling_folder import load_pooling_folder
    from tests.e2e.pooling_kit import folder_tokenizer, sentence_transformer, st_folder, texts

    folder = st_folder("llama", tmp_path / "st", "mean", normalize=True)
    loaded = load_pooling_folder(folder)
    facade = serving_facade(
        loaded.model, TorchBackend(), max_seq_len=256, max_batch_size=4, policy=POLICY, pooler=loaded.pooler,
        score=loaded.score,
    )  # fmt: skip
    spec = loaded.model.spec
    facade.allocate_kv_cache((48, spec.num_kv_heads, BLOCK, spec.head_dim), loaded.model.dtype, spec.num_layers)
    rows = texts(0, [150, 40, 1])
    ids = [folder_tokenizer("llama", folder)(text)["input_ids"] for text in rows]
    lengths = [len(i) for i in ids]
    tokens = torch.zeros(len(ids), max(lengths), dtype=torch.int64)
    for row, row_ids in enumerate(ids):
        tokens[row, : len(row_ids)] = torch.tensor(row_ids)
    table = page_table(assign_blocks(lengths, BLOCK, 48, seed=0))
    out = facade.prefill_forward(
        tokens, table, enable_trace=False, prompt_lens=torch.tensor(lengths), pooling=[PoolingParams.embed()] * 3
    )
    theirs = sentence_transformer("llama", folder).encode(rows, convert_to_tensor=True)
    for row in range(len(rows)):
        _close(out[row], theirs[row].float())
