"""vLLM 0.33's own scheduler with pooling requests drives the runtime; the outputs equal sentence-transformers and
transformers (issue 58 item 4(b)).

vLLM reads each random folder (``pooling_kit``: Llama, Qwen2, Qwen3 and Mistral, written by sentence-transformers 6.3
and transformers 5) as a pooling model, and its defaults decide the schedule (``pooling_runner.pooling_setup``):
a LAST model gets chunked prefill under a 48-token budget and prefix caching, a MEAN or CLS model neither (vLLM
refuses partial prefill for them), so each such prompt is one vLLM step that the runtime computes in 64-token
chunks.
Requests carry vLLM's own ``PoolingParams`` (task ``embed`` or ``classify``, ``dimensions``,
``use_activation``), verified against vLLM's model config and mapped field by field
(``pooling_runner.project_params``); each step is one ``prefill_forward(..., pooling=, pooling_prompt_lens=)`` of
the facade built with the folder's ``pooler`` and ``score``, and its return goes as it is into
``ModelRunnerOutput.pooler_output`` for ``update_from_output``, whose outputs are checked against
``SentenceTransformer.encode`` and ``*ForSequenceClassification`` within 1e-5 relative (raw and cosine), eager
and traced.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` builds the venv that has it")
pytest.importorskip("sentence_transformers")

import torch
from vllm.pooling_params import PoolingParams as VllmPoolingParams
from vllm.v1.request import Request

from prefill_core import PrefillPolicy
from prefill_core.values.pooling import InvalidPoolingError, PoolingPrefixError, PoolingType, resolve_pooling
from prefill_shell.backends.torch_backend import TorchBackend
from prefill_shell.pooling import PoolingRunner, RuntimePoolingModel
from prefill_shell.reference.loading.pooling_folder import load_pooling_folder
from prefill_shell.serving import serving_facade
from tests.e2e.pooling_kit import (
    ALL_FAMILIES,
    cross_encoder,
    folder_tokenizer,
    sentence_transformer,
    seq_cls_folder,
    st_folder,
    texts,
    tokenizer_option,
)
from tests.family_kit import relative_error
from tests.vllm import vllm_side
from tests.vllm.checkpoints import BLOCK
from tests.vllm.pooling_runner import (
    PoolingPluginRunner,
    plugin_pooling_step,
    pooling_model_config,
    pooling_setup,
    project_params,
)

RTOL = 1e-5
SEQS = 4
MAX_BLOCKS = vllm_side.MAX_MODEL_LEN // BLOCK
POLICY = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4), lane_size=SEQS)
BUDGET = 48  # max_num_batched_tokens where vLLM chunks: a 170-token prompt takes four steps


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def family(request):
    return request.param


@functools.cache
def _folder(family: str, kind: str) -> Path:
    """One random folder per family and kind, written once per session by sentence-transformers or transformers."""
    root = Path(tempfile.mkdtemp(prefix=f"vllm-pooling-{family}-{kind}-"))
    if kind == "last":  # LAST pooling and a Normalize module: vLLM's default use_activation is True
        return st_folder(family, root / "st", "lasttoken", normalize=True)
    if kind in ("mean", "cls"):  # no Normalize module: vLLM's default use_activation is False
        return st_folder(family, root / "st", kind, normalize=False)
    assert kind == "classify"
    return seq_cls_folder(family, root / "cls", num_labels=3)


def _waves(seed: int) -> list[list[str]]:
    """Two waves of texts: 170 and 40 words, then rows sharing the first one's 96-word (six-block) prefix, a
    one-word row and another past one chunk; the second wave is added once the first has finished."""
    first, *shared = texts(seed, [170, 150, 120], shared=96)
    return [[first, texts(seed + 1, [40])[0]], [*shared, *texts(seed + 2, [1, 100])]]


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Within ``RTOL`` of the largest magnitude of ``theirs``, or of 1 where that is smaller: a cross-encoder's one
    raw logit (0.1 on random weights) comes from hidden states of scale 1, whose float32 rounding moves it by a
    few 1e-6 whenever the summation order changes (rows sharing a span take its K/V from another row, so their
    attention blocks its keys differently: ``prefill_core.planning.shared_spans``)."""
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    ours, theirs = ours.float(), theirs.float()
    error = float((ours - theirs).abs().max()) / max(float(theirs.abs().max()), 1.0)
    assert error <= RTOL, (error, relative_error(ours, theirs), ours[:4], theirs[:4])
    cosine = float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0))
    assert cosine >= 1 - RTOL, cosine


def _facade(loaded, kv_config):
    """The plugin's facade over a loaded pooling folder: its body, and its pooler and head for ``pooling=``."""
    model = loaded.model
    facade = serving_facade(
        model, TorchBackend(), max_seq_len=vllm_side.MAX_MODEL_LEN, max_batch_size=SEQS, policy=POLICY,
        pooler=loaded.pooler, score=loaded.score,
    )  # fmt: skip
    spec = model.spec
    kv = facade.allocate_kv_cache(
        (kv_config.num_blocks, spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers
    )
    return facade, kv


def _drive(family: str, folder: Path, params_of, *, enable_trace: bool):
    """Runs the waves through vLLM's scheduler and the runtime; ``params_of(i)`` is request i's vLLM
    ``PoolingParams``. Returns ``(runner, {request id: (text, verified vLLM params)})``."""
    model_config = pooling_model_config(folder)
    loaded = load_pooling_folder(folder)
    # vLLM and the project read the same folder into the same pooling.
    assert PoolingType(model_config.pooler_config.seq_pooling_type) is loaded.pooler.pooling_type
    scheduler, kv_config = pooling_setup(
        model_config, loaded.model.spec, num_blocks=64, token_budget=BUDGET, max_num_seqs=SEQS
    )
    assert scheduler.num_sampled_tokens_per_step == 0  # a pooling model: no sampled token after the prompt
    facade, kv = _facade(loaded, kv_config)
    facade.warmup_model_prefill(kv_cache=kv, can_sample_on_device=False, enable_trace=enable_trace)
    tokenizer = folder_tokenizer(family, folder)
    requests: dict[str, tuple[str, VllmPoolingParams]] = {}
    runner = PoolingPluginRunner(
        facade, kv, scheduler, enable_trace=enable_trace, max_num_seqs=SEQS, max_blocks=MAX_BLOCKS
    )
    hasher, count = vllm_side.block_hasher(), 0
    for wave in _waves(0):
        for text in wave:
            params = params_of(count)
            params.verify(model_config)  # vLLM's input processor: the model's defaults merged, the fields checked
            req_id = f"p{count}"
            requests[req_id] = (text, params)
            runner.add(Request(req_id, tokenizer(text)["input_ids"], None, params, block_hasher=hasher))
            count += 1
        runner.run()
    if enable_trace:
        assert sum(trace.replays for trace in facade.runtime.captured_traces()) > 0
    facade.cleanup()
    assert set(runner.outputs) == set(requests) and runner.stats.finished == len(requests)
    assert set(runner.finish_reasons.values()) == {"stop"}
    return runner, requests


EMBED_PARAMS = [
    dict(),  # the folder's default: normalised where it has a Normalize module
    dict(use_activation=False),
    dict(dimensions=24),  # truncated, then normalised as the default says
    dict(dimensions=24, use_activation=False),
    dict(use_activation=True),
]


def _embed_params(i: int) -> VllmPoolingParams:
    return VllmPoolingParams(task="embed", **EMBED_PARAMS[i % len(EMBED_PARAMS)])


def _st_oracle(family: str, folder: Path, text: str, params: VllmPoolingParams) -> torch.Tensor:
    """sentence-transformers' embedding of ``text`` as the verified params ask: its modules without Normalize
    for an un-normalised vector, ``truncate_dim`` and ``normalize_embeddings`` (truncate, then normalise)."""
    from sentence_transformers import SentenceTransformer

    st = _sentence_transformer(family, folder)
    if not params.use_activation:
        st = SentenceTransformer(modules=[module for module in st if type(module).__name__ != "Normalize"])
    return st.encode(
        [text], convert_to_tensor=True, truncate_dim=params.dimensions, normalize_embeddings=params.use_activation
    )[0]


@functools.cache
def _sentence_transformer(family: str, folder: Path):
    return sentence_transformer(family, folder)


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager", "traced"])
def test_last_embeddings_chunked_and_prefix_cached_by_vllm_equal_sentence_transformers(family, enable_trace):
    """LAST: vLLM chunks the long prompts over several steps and serves the second wave's shared prefix from its
    cache; each request's pooled output appears on its last step and equals ``SentenceTransformer.encode``."""
    folder = _folder(family, "last")
    model_config = pooling_model_config(folder)
    assert model_config.is_chunked_prefill_supported and model_config.is_prefix_caching_supported
    assert model_config.pooler_config.use_activation is True  # vLLM read the Normalize module
    runner, requests = _drive(family, folder, _embed_params, enable_trace=enable_trace)
    for req_id, (text, params) in requests.items():
        _close(runner.outputs[req_id], _st_oracle(family, folder, text, params))
    assert runner.stats.prefix_hit_tokens >= 2 * 96  # both shared rows started past the first row's six blocks
    assert max(runner.steps_of.values()) >= 4  # a 170-token prompt at 48 tokens a step


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("kind", ["mean", "cls"])
def test_mean_and_cls_embeddings_whole_prompts_as_vllm_schedules_them_equal_sentence_transformers(
    family, kind, enable_trace
):
    """MEAN and CLS: vLLM turns chunked prefill and prefix caching off for such a model, so every prompt is one
    step (the runtime chunks it past 64 tokens; MEAN sums across its chunks) and nothing is read from vLLM's
    prefix cache."""
    folder = _folder(family, kind)
    model_config = pooling_model_config(folder)
    assert not model_config.is_chunked_prefill_supported and not model_config.is_prefix_caching_supported
    assert model_config.pooler_config.use_activation is False  # no Normalize module
    runner, requests = _drive(family, folder, _embed_params, enable_trace=enable_trace)
    for req_id, (text, params) in requests.items():
        _close(runner.outputs[req_id], _st_oracle(family, folder, text, params))
    assert runner.stats.prefix_hit_tokens == 0
    assert set(runner.steps_of.values()) == {1}


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager", "traced"])
def test_classification_chunked_and_prefix_cached_by_vllm_equals_transformers(family, enable_trace):
    """Three labels, LAST: raw logits (``use_activation=False``) and vLLM's softmax, against transformers'
    ``*ForSequenceClassification`` on the same folder."""
    import transformers

    folder = _folder(family, "classify")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = folder_tokenizer(family, folder)

    def params_of(i: int) -> VllmPoolingParams:
        return VllmPoolingParams(task="classify", use_activation=None if i % 2 else False)

    runner, requests = _drive(family, folder, params_of, enable_trace=enable_trace)
    for req_id, (text, params) in requests.items():
        with torch.no_grad():
            logits = hf(**tokenizer(text, return_tensors="pt")).logits[0]
        _close(runner.outputs[req_id], logits.softmax(-1) if params.use_activation else logits)
    assert runner.stats.prefix_hit_tokens >= 2 * 96
    assert max(runner.steps_of.values()) >= 4


def test_what_vllm_refuses_the_mapped_params_refuse_by_name(family):
    """vLLM's token-wise tasks map onto a task the project refuses by name; ``dimensions`` on a classify request
    is refused by vLLM's ``verify`` and, mapped, by ``resolve_pooling``."""
    from vllm.exceptions import VLLMValidationError

    folder = _folder(family, "classify")
    pooler = load_pooling_folder(folder).pooler
    with pytest.raises(InvalidPoolingError, match="token-wise"):
        resolve_pooling(0, project_params(VllmPoolingParams(task="token_embed")), pooler)
    params = VllmPoolingParams(task="classify", dimensions=24)
    with pytest.raises(VLLMValidationError, match="dimensions"):
        params.clone().verify(pooling_model_config(folder))
    with pytest.raises(InvalidPoolingError, match="dimensions"):
        resolve_pooling(0, project_params(params), pooler)


def test_mean_under_forced_chunked_prefill_is_refused_by_name(family):
    """With chunked prefill forced on for a MEAN model (vLLM warns that it may produce incorrect outputs, and its
    ``MeanPool`` raises on a partial prefill), the first step's partial prefill of the prompt is refused by the
    facade as vLLM's pooler refuses it: a ``PoolingPrefixError`` naming the row, before any KV is written (never
    a mean over one chunk alone)."""
    folder = _folder(family, "mean")
    model_config = pooling_model_config(folder)
    loaded = load_pooling_folder(folder)
    scheduler, kv_config = pooling_setup(
        model_config, loaded.model.spec, num_blocks=64, token_budget=BUDGET, max_num_seqs=SEQS, chunked=True
    )
    facade, kv = _facade(loaded, kv_config)
    facade.warmup_model_prefill(kv_cache=kv, can_sample_on_device=False, enable_trace=False)
    runner = PoolingPluginRunner(facade, kv, scheduler, enable_trace=False, max_num_seqs=SEQS, max_blocks=MAX_BLOCKS)
    params = VllmPoolingParams(task="embed")
    params.verify(model_config)
    runner.add(Request("long", list(range(4, 104)), None, params, block_hasher=vllm_side.block_hasher()))
    before = [kv.block_bytes(block) for block in range(kv.num_blocks)]
    rule = r"row 0: prompt_lens=48 is invalid: MEAN pooling needs the whole prompt \(100 tokens\) in one step"
    with pytest.raises(PoolingPrefixError, match=rule):
        runner.step()  # vLLM scheduled the first 48 tokens of 100
    assert all(torch.equal(kv.block_bytes(block), old) for block, old in enumerate(before))
    assert runner.outputs == {}
    facade.cleanup()


@pytest.mark.parametrize("kind", ["mean", "cross-encoder"])
def test_the_plugins_pooling_runner_over_runtime_pooling_model_equals_sentence_transformers(family, kind):
    """vllm-tt-plugin's own pooling runner loop (``pooling_runner.plugin_pooling_step``) behind vLLM's scheduler,
    its model ``RuntimePoolingModel``: whole prompts per step whatever vLLM scheduled (a MEAN model, which vLLM
    schedules whole, and a one-label cross-encoder, which vLLM would chunk), the folder's default embedding or the
    raw relevance logit ``[1]`` per request, equal to ``SentenceTransformer.encode`` / ``CrossEncoder.predict``."""
    if kind == "mean":
        folder = _folder(family, "mean")
    else:
        folder = seq_cls_folder(family, Path(tempfile.mkdtemp(prefix="vllm-pooling-ce-")) / "ce", num_labels=1)
    model_config = pooling_model_config(folder)
    runner = PoolingRunner.from_folder(folder, block_size=BLOCK, max_chunk=64, **tokenizer_option(family, folder))
    scheduler, _ = pooling_setup(model_config, runner.model.spec, num_blocks=64, token_budget=BUDGET, max_num_seqs=SEQS)
    tokenizer = folder_tokenizer(family, folder)
    rows = [text for wave in _waves(3) for text in wave]
    query = texts(4, [20])[0]
    hasher, outputs = vllm_side.block_hasher(), {}
    for i, text in enumerate(rows):
        task = "embed" if kind == "mean" else "classify"
        params = VllmPoolingParams(task=task)
        params.verify(model_config)
        ids = tokenizer(text)["input_ids"] if kind == "mean" else tokenizer(query, text)["input_ids"]
        scheduler.add_request(Request(f"q{i}", ids, None, params, block_hasher=hasher))
    model = RuntimePoolingModel(runner)
    while scheduler.has_requests():
        outputs.update(plugin_pooling_step(scheduler, model))
    assert len(outputs) == len(rows)
    if kind == "mean":
        theirs = sentence_transformer(family, folder).encode(rows, convert_to_tensor=True)
    else:
        pairs = [(query, text) for text in rows]
        raw = torch.nn.Identity()
        theirs = cross_encoder(family, folder).predict(pairs, convert_to_tensor=True, activation_fn=raw)[:, None]
    for i in range(len(rows)):
        _close(outputs[f"q{i}"], theirs[i])
