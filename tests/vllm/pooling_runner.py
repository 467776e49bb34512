"""vLLM 0.33's scheduler with pooling requests, driving the runtime behind the plugin's facade.

``pooling_setup`` configures vLLM as its engine would for a pooling folder:
``ModelConfig(runner="pooling")`` reads the folder's pooling itself
(``vllm/transformers_utils/config.py`` ``get_pooling_config`` for a
sentence-transformers folder; LAST for a ``*ForSequenceClassification``),
and chunked prefill and prefix caching are what that model config supports
(``vllm/config/model.py`` ``is_chunked_prefill_supported`` /
``is_prefix_caching_supported``: on for LAST, off for MEAN and CLS on a
causal body; ``vllm/engine/arg_utils.py`` takes them as the defaults).

``PoolingPluginRunner`` is ``plugin_runner.PluginRunner``'s step (vLLM's
block ids, ``start_pos`` = computed tokens, persistent batch slots, no KV
byte outside a step's written blocks changed) with a pooled result instead
of a sampled token: each step is one ``facade.prefill_forward`` with
``pooling=`` (each row's request's ``PoolingParams``, recorded when vLLM
schedules it as new, as the GPU runner's input batch keeps them) and
``pooling_prompt_lens=`` (each row's whole prompt), and its return is the
step's ``pooler_output`` as it is: a row's vector once its prompt is
complete and None for a partial prefill, as vLLM's GPU runner hands it over
(``vllm/v1/worker/gpu_model_runner.py`` ``_pool``). ``update_from_output``
then finishes every request with an output
(``vllm/v1/core/sched/scheduler.py``: "Pooling stops as soon as there is
output"); what it hands back per request is ``outputs``.
"""

from __future__ import annotations

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.pooling_params import PoolingParams as VllmPoolingParams
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from prefill_core.values.pooling import PoolingParams
from tests.vllm.checkpoints import BLOCK
from tests.vllm.plugin_runner import PluginRunner
from tests.vllm.vllm_side import MAX_MODEL_LEN, layer_name


def pooling_model_config(folder) -> ModelConfig:
    """vLLM's model config of a pooling folder (inspected, never run)."""
    return ModelConfig(
        model=str(folder), runner="pooling", skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN
    )


def pooling_setup(
    model_config: ModelConfig, spec, *, num_blocks: int, token_budget: int, max_num_seqs: int, chunked=None
):
    """``(scheduler, kv_cache_config)``: chunked prefill and prefix caching as vLLM's defaults set them for this
    model (``chunked`` overrides the first, as ``--enable-chunked-prefill`` does); without chunked prefill vLLM
    needs a budget of at least ``max_model_len`` (``SchedulerConfig``)."""
    chunked = model_config.is_chunked_prefill_supported if chunked is None else chunked
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=model_config.is_prefix_caching_supported)
    scheduler = SchedulerConfig(
        max_num_batched_tokens=token_budget if chunked else max(token_budget, MAX_MODEL_LEN),
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        is_encoder_decoder=False,
    )
    config = VllmConfig(
        model_config=model_config,
        cache_config=cache,
        scheduler_config=scheduler,
        device_config=DeviceConfig(device="cpu"),
    )
    config.cache_config.kv_cache_layout = "LBHNC"
    common = dict(block_size=BLOCK, num_kv_heads=spec.num_kv_heads, head_size=spec.head_dim, dtype=torch.float32)
    specs = {layer_name(layer): FullAttentionSpec(**common) for layer in range(spec.num_layers)}
    groups = get_kv_cache_groups(config, specs)
    page = next(iter(specs.values())).page_size_bytes
    kv_config = get_kv_cache_config_from_groups(config, groups, num_blocks * page * spec.num_layers)
    assert kv_config.num_blocks == num_blocks
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BLOCK, log_stats=True), kv_config


def project_params(params: VllmPoolingParams) -> PoolingParams:
    """A request's vLLM ``PoolingParams`` (after ``verify`` merged the model's defaults) as the project's.

    Field by field, as vLLM 0.33 means them:

    * ``task``: ``embed`` or ``classify`` carry over; the token-wise tasks too,
      for ``resolve_pooling`` to refuse by name (``vllm/pooling_params.py``
      ``valid_parameters``).
    * ``dimensions`` (embed): Matryoshka truncation, applied before the
      activation (``vllm/model_executor/layers/pooler/seqwise/heads.py``
      ``EmbeddingPoolerHead.forward``); the project's ``dimensions``.
    * ``use_activation``: for embed, the embedding head's activation, which is
      the L2 normalisation (``vllm/config/pooler.py`` refuses the removed
      ``normalize`` with "use ``use_activation`` instead"; its default comes
      from the folder's Normalize module): the project's ``normalize``. For
      classify, the classifier head's activation
      (``ClassifierPoolerHead.forward``; sigmoid or softmax by
      ``vllm/model_executor/layers/pooler/activations.py``): the project's
      ``use_activation``.
    """
    if params.task == "embed":
        return PoolingParams.embed(dimensions=params.dimensions, normalize=params.use_activation)
    if params.task == "classify":  # dimensions carried over for resolve_pooling to refuse, as vLLM's verify does
        return PoolingParams("classify", dimensions=params.dimensions, use_activation=params.use_activation)
    return PoolingParams(task=params.task)


class PoolingPluginRunner(PluginRunner):
    """``PluginRunner`` with pooling requests, the facade built with the folder's ``pooler=`` and ``score=``:
    ``outputs`` collects what vLLM's ``update_from_output`` reports for each finished request, ``steps_of``
    how many steps computed each."""

    def __init__(self, facade, kv, scheduler, *, enable_trace: bool, max_num_seqs: int, max_blocks: int):
        super().__init__(
            facade, kv, scheduler, None, enable_trace=enable_trace, max_num_seqs=max_num_seqs, max_blocks=max_blocks
        )
        self.params: dict[str, PoolingParams] = {}  # each live request's, projected (the input batch's copy)
        self.outputs: dict[str, torch.Tensor] = {}
        self.finish_reasons: dict[str, str] = {}
        self.steps_of: dict[str, int] = {}

    def step(self) -> None:
        out, rows = self.schedule()
        for new in out.scheduled_new_reqs:  # a resumed request comes back as new, with its params
            self.params[new.req_id] = project_params(new.pooling_params)
        pooled: list[torch.Tensor | None] = []
        if rows:
            call = self.prepare(rows, out.num_scheduled_tokens)
            pooled = self.facade.prefill_forward(
                call.tokens,
                call.tables[0][: len(rows)],
                enable_trace=self.enable_trace,
                prompt_lens=torch.tensor(call.ends),
                start_pos=torch.tensor(call.starts),
                empty_slots=[self.slots[r] for r in rows],
                kv_cache=self.kv,
                pooling=[self.params[r] for r in rows],
                pooling_prompt_lens=[len(self.live[r].prompt) for r in rows],
            )
            for block, old in call.before.items():
                assert torch.equal(self.kv.block_bytes(block), old), f"block {block} changed outside the step's writes"
            for i, r in enumerate(rows):
                self.steps_of[r] = self.steps_of.get(r, 0) + 1
                done = call.ends[i] == len(self.live[r].prompt)
                assert (pooled[i] is not None) == done, (r, call.ends[i], len(self.live[r].prompt))
                self.stats.finished += done
        runner_out = ModelRunnerOutput(
            req_ids=rows, req_id_to_index={r: i for i, r in enumerate(rows)}, pooler_output=pooled
        )
        for engine_outputs in self.scheduler.update_from_output(out, runner_out).values():
            for output in engine_outputs.outputs:
                assert output.pooling_output is not None and output.finished, output
                self.outputs[output.request_id] = output.pooling_output
                self.finish_reasons[output.request_id] = str(output.finish_reason)
        for req_id in list(self.live):
            if self.scheduler.requests.get(req_id) is None:
                del self.live[req_id]
                self.slots.pop(req_id, None)
                self.params.pop(req_id, None)


def plugin_pooling_step(scheduler, model) -> dict[str, torch.Tensor]:
    """One step of vllm-tt-plugin's ``TTPoolingModelRunner`` (``pooling_runner.py``) over ``model``: every newly
    scheduled request's whole prompt, right-padded with a float 0/1 mask, in one ``model.forward(input_ids,
    attention_mask)``; row i to ``pooler_output``. It reads neither ``num_scheduled_tokens``, the blocks nor the
    requests' ``pooling_params`` (so a chunked request finishes on its first step, and every row gets what the
    model's one ``pooling`` says). Returns the outputs ``update_from_output`` reports, by request id."""
    out = scheduler.schedule()
    new = out.scheduled_new_reqs
    assert not out.scheduled_cached_reqs.req_ids  # nothing continues: every request finished on its first step
    pooled: list[torch.Tensor | None] = []
    if new:
        longest = max(len(r.prompt_token_ids) for r in new)
        tokens = torch.zeros(len(new), longest, dtype=torch.int64)
        mask = torch.zeros(len(new), longest, dtype=torch.float32)
        for i, r in enumerate(new):
            tokens[i, : len(r.prompt_token_ids)] = torch.tensor(r.prompt_token_ids)
            mask[i, : len(r.prompt_token_ids)] = 1.0
        outputs = model.forward(input_ids=tokens, attention_mask=mask)
        pooled = [outputs[i] for i in range(len(new))]
    rows = [r.req_id for r in new]
    runner_out = ModelRunnerOutput(
        req_ids=rows,
        req_id_to_index={r: i for i, r in enumerate(rows)},
        sampled_token_ids=[[] for _ in rows],
        pooler_output=pooled,
    )
    reported = {}
    for engine_outputs in scheduler.update_from_output(out, runner_out).values():
        for output in engine_outputs.outputs:
            assert output.finished
            reported[output.request_id] = output.pooling_output
    return reported
