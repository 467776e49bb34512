"""``ServingFacade``: the runtime behind a serving engine, called as vLLM's Tenstorrent plugin calls a model.

``PluginFacade`` is the one normalisation, sampling and return path of the
plugin's generator facade (``model_capabilities``, ``allocate_kv_cache``,
``warmup_model_prefill``, ``prefill_forward``); ``ServingFacade`` composes it
with ``OneLane`` (one ``PrefillExecutor``), ``lane_facade.LaneGroupFacade``
with a lane group. The call, its refusals, returns and sampling encodings:
docs/serving.md; pooling requests (``pooling=``, vLLM's ``pooler_output``):
``pooled_output`` and docs/pooling.md.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from prefill_core import (
    ExecutionMode,
    PageTableLayout,
    PrefillPolicy,
    SamplingPath,
    ceil_div,
    manifest_for,
    route_to_lanes,
)
from prefill_core.calls.trace_check import replays_call
from prefill_core.calls.warmup import limited_to
from prefill_core.values.errors import KVCacheMismatchError, PrefillConfigError, PrefillInputError, PrefillStateError
from prefill_core.values.pooling import InvalidPoolingError
from prefill_shell.backends.base import Backend
from prefill_shell.device.model import PrefillModel
from prefill_shell.device.notes import add_note
from prefill_shell.engine.batch_builder import as_token_matrix
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.progress import ProgressCallback
from prefill_shell.engine.result import BatchResult
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.sampling.penalties import sample_penalised
from prefill_shell.serving.penalty_state import check_slot_remap, state_rows, token_ids
from prefill_shell.serving.plugin_sampling import PluginRows, rows_from_plugin
from prefill_shell.serving.pooled_output import PoolingHead, pooled_rows, pooler_output

__all__ = ["CHECKED_KEYWORDS", "IGNORED_KEYWORDS", "OneLane", "PluginFacade", "ServingFacade"]

IGNORED_KEYWORDS = frozenset({"prompt_tokens", "output_tokens", "slot_remap", "rope_deltas_all_users"})
"""The plugin's keywords a text-only model accepts without a check of KV addressing (``prompt_tokens`` and
``output_tokens`` feed the penalties, ``slot_remap`` is checked against the lane's slots)."""
CHECKED_KEYWORDS = frozenset({"page_tables_per_layer"})
"""The plugin's keywords that say which blocks a layer reads and writes: never ignored. A model in one KV group
takes ``page_tables_per_layer`` only equal to ``page_table`` on every layer (``HybridServingFacade`` serves
several groups)."""

_PROVISIONAL_BLOCK_SIZE = 32
_LOG = logging.getLogger(__name__)
_NO_POOL_NOTE = (
    "allocate_kv_cache released the previous KV pool and its runtime before this build failed: "
    "no pool is allocated now; call allocate_kv_cache again (a smaller pool, or after freeing memory)"
)


class PluginFacade:
    """What the plugin calls (``allocate_kv_cache``, ``warmup_model_prefill``, ``can_trace``, ``prefill_forward``,
    ``cleanup``), over the lanes a facade serves.

    ``ServingFacade`` (one lane) and ``serving.lane_facade.LaneGroupFacade``
    (one lane per data-parallel rank) are this class over a different
    ``lanes`` object (``OneLane``, ``lane_facade.LaneGroupLanes``): what is
    lane-shaped (building and releasing pools, what ``kv_cache`` must be,
    what runs a call) is the lanes', everything the plugin sees is here, once.
    """

    model_capabilities = {
        "supports_prefix_caching": True,
        "supports_async_decode": False,  # prefill only: there is no decode here
        "supports_sample_on_device": True,
        "accepts_trace_mode": True,
        "supports_chunked_prefill": True,
    }

    def __init__(
        self,
        lanes: Any,
        *,
        max_seq_len: int,
        max_batch_size: int,
        policy: PrefillPolicy | None,
        kv_dtype: torch.dtype | None,
        prefill_traces: bool,
        seed: int,
        warmup_lengths: Sequence[int] | None = None,
        pooler: Any = None,
        score: torch.Tensor | None = None,
    ):
        for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
            if type(value) is not int or value <= 0:
                raise PrefillConfigError(f"{type(self).__name__}: {name}={value!r} is invalid: must be an int > 0")
        model = lanes.model
        self.lanes = lanes
        self.model = model
        self.backend = lanes.backend
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.policy = policy
        self.prefill_traces = prefill_traces
        self.warmup_lengths = None if warmup_lengths is None else tuple(warmup_lengths)
        if kv_dtype is not None and kv_dtype != getattr(model, "dtype", None):
            rule = (
                f"must be None or the model's dtype {getattr(model, 'dtype', None)}: the KV pool is built in, and "
                "the model runs on, the model's dtype (load the model in the dtype you want)"
            )
            raise PrefillConfigError(f"{type(self).__name__}: kv_dtype={kv_dtype!r} is invalid: {rule}")
        self._kv_dtype = model.dtype
        self._rng = random.Random(seed)
        self.kv: Any = None
        # What pooling requests are resolved against (``pooled_output``); None: the facade refuses them.
        self.pooling_head = PoolingHead.of(type(self).__name__, pooler, score, lanes.lane_models)

    def _lane_executor(self, model, backend, kv, num_blocks: int, block_size: int, seed: int) -> PrefillExecutor:
        """One lane's executor over ``kv``: the facade's layout, and its policy with the lane's slots."""
        layout = PageTableLayout(block_size, ceil_div(self.max_seq_len, block_size), num_blocks)
        policy = self.policy or backend.preferred_policy(block_size)
        if isinstance(policy, PrefillPolicy):
            # The plugin numbers a lane's rows 0..max_num_seqs-1: the core's slot rule refuses any slot past them.
            policy = attrs.evolve(policy, lane_size=self.lanes.pool_rows)
        config = PrefillRuntimeConfig.resolve(model, backend, kv, layout=layout, policy=policy)
        return PrefillExecutor(PrefillRuntime(config, seed=seed))

    # -- set-up ---------------------------------------------------------
    def allocate_kv_cache(self, kv_cache_shape=None, dtype=None, num_layers=None) -> Any:
        """Builds the KV pool and the runtime over it; returns the pool (pass it back as ``kv_cache``).

        All three arguments or none (``TypeError``). Without them the pool is
        the provisional one (block size 32, the longest sequence plus one
        block per row). With them, ``kv_cache_shape`` is vLLM's rank-4
        ``(num_blocks, kv_heads, block_size, head_dim)``, checked against the
        model (``PrefillConfigError``; ``kv_heads`` per device, as vLLM divides
        them over a lane of several devices), and vLLM's block size replaces the
        provisional one: the layout is rebuilt before any warm-up.
        """
        supplied = (kv_cache_shape is not None, dtype is not None, num_layers is not None)
        if any(supplied) and not all(supplied):
            raise TypeError("kv_cache_shape, dtype, and num_layers must be supplied together")
        if all(supplied):
            num_blocks, block_size = self._checked_shape(kv_cache_shape, dtype, num_layers)
        else:
            block_size = _PROVISIONAL_BLOCK_SIZE
            num_blocks = ceil_div(self.max_seq_len, block_size) + self.lanes.pool_rows
        self._release()  # before the build: a device holds one pool, never the old and the new together
        try:
            self.kv = self.lanes.build(num_blocks, block_size, self._lane_executor)
        except BaseException as error:
            add_note(error, _NO_POOL_NOTE)
            raise
        return self.kv

    def _checked_shape(self, shape, dtype, num_layers) -> tuple[int, int]:
        spec = self.model.spec
        dims = tuple(shape) if isinstance(shape, Sequence) else (shape,)
        if len(dims) != 4 or not all(type(d) is int for d in dims):
            msg = f"kv_cache_shape={dims!r} is invalid: must be 4 ints (num_blocks, kv_heads, block_size, head_dim)"
            raise PrefillConfigError(msg)
        num_blocks, kv_heads, block_size, head_dim = (int(d) for d in dims)
        expected = (
            ("num_blocks", num_blocks, num_blocks if num_blocks > 0 else "> 0"),
            ("block_size", block_size, block_size if block_size > 0 else "> 0"),
            ("kv_heads", kv_heads, _kv_heads_per_device(spec.num_kv_heads, getattr(self.backend, "num_devices", 1))),
            ("head_dim", head_dim, spec.head_dim),
            ("num_layers", num_layers, spec.num_layers),
            ("dtype", dtype, self._kv_dtype),
        )
        for name, got, want in expected:
            if got != want:
                raise PrefillConfigError(f"vLLM's KV {name}={got!r} is invalid: the model needs {want}")
        return num_blocks, block_size

    def warmup_model_prefill(
        self,
        *,
        kv_cache: Any,
        can_sample_on_device: bool,
        enable_trace: bool,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        """Compiles every program the layout can plan (and captures every trace when ``enable_trace``).

        The logits and host paths always; the argmax and device top-k paths
        when ``can_sample_on_device``; only ``warmup_lengths`` when given.
        Every lane, in lane order. Where the backend builds nothing per shape
        (the CPU) the compile phase runs only the smallest body. Before each
        lane starts, its cost (bodies, positions, persistent bytes) is logged
        and reported to ``on_progress`` as stage ``"cost"`` (``PrefillExecutor.warm_up``).
        """
        self._check_call(kv_cache, enable_trace)
        if not isinstance(can_sample_on_device, bool):
            raise TypeError("can_sample_on_device must be bool")
        paths = [SamplingPath.LOGITS, SamplingPath.HOST]
        if can_sample_on_device:
            paths += [SamplingPath.ARGMAX, SamplingPath.TOPK]
        for lane, executor in enumerate(self.lanes.executors()):
            config = executor.runtime.config
            manifest = manifest_for(
                config.policy, config.layout, paths, attention=getattr(self.model, "attention", None)
            )
            if self.warmup_lengths is not None:
                manifest = limited_to(manifest, self.warmup_lengths)
            cost = executor.cost(manifest, capture=enable_trace)
            _LOG.info("warmup_model_prefill lane %d (enable_trace=%s): %s", lane, enable_trace, cost)
            if enable_trace:
                executor.warm_up(manifest, on_progress)
            else:
                executor.compile_programs(manifest, on_progress)

    # -- the call -------------------------------------------------------
    def can_trace(self, *, tokens, prompt_lens=None, start_pos=None) -> bool:
        """Whether ``prefill_forward(..., enable_trace=True)`` of this geometry replays on what was warmed up.

        It reads the arguments' shapes and values only (nothing is staged,
        nothing allocated, nothing runs) and answers False, never raises, for
        input a call would refuse: tokens that are not a non-empty 2-D
        integer tensor, ``prompt_lens``/``start_pos`` that are not one int
        per row, ``start_pos`` outside ``[0, prompt_lens]``, ``prompt_lens``
        past the token width or the layout's capacity; and when prefill
        traces are off or no pool is allocated yet. Otherwise each lane's
        rows (routed as a call without ``empty_slots`` is) are planned as the
        traced call would plan them, against that lane's captured traces
        (``prefill_core.replays_call``): True exactly when that call runs.
        """
        if not self.prefill_traces or not self.lanes.built:
            return False
        tokens = _cast(tokens, torch.int64)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype is not torch.int64:
            return False
        num_rows, width = tokens.shape
        lengths = _int_list(_cast(prompt_lens, torch.int64), [width] * num_rows)
        cached = _int_list(_cast(start_pos, torch.int64), [0] * num_rows)
        if lengths is None or cached is None or any(n > width for n in lengths):
            return False
        executors = self.lanes.executors()
        if len(executors) == 1:
            context = executors[0].runtime.call_context(ExecutionMode.TRACED)
            return replays_call(lengths, cached, context)
        per_lane = executors[0].runtime.config.policy.lane_size
        try:
            routes = route_to_lanes(None, num_rows, per_lane, len(executors))
        except PrefillInputError:
            return False
        return all(
            replays_call(
                [lengths[r] for r in route.source_rows],
                [cached[r] for r in route.source_rows],
                executors[route.lane].runtime.call_context(ExecutionMode.TRACED),
                route.slots,
            )
            for route in routes
        )

    def prefill_forward(
        self,
        tokens,
        page_table,
        *,
        enable_trace: bool,
        prompt_lens=None,
        start_pos=None,
        empty_slots=None,
        kv_cache=None,
        sampling_params=None,
        pooling: Sequence | None = None,
        pooling_prompt_lens=None,
        **compatibility_kwargs: Any,
    ):
        """One prefill step as the plugin submits it; see the module docstring for the returns.

        ``pooling``: one ``prefill_core`` ``PoolingParams`` or None per row (a facade built with ``pooler=``);
        ``pooling_prompt_lens``: each row's whole prompt length (default ``prompt_lens``: every step completes
        its rows' prompts). Then the return is vLLM's ``pooler_output``: per row, the head's float32 output on
        the host where this step completes a pooled row's prompt, else None (``pooled_output``).
        """
        unknown = sorted(key for key in compatibility_kwargs if key not in IGNORED_KEYWORDS | CHECKED_KEYWORDS)
        if unknown:
            raise TypeError(f"prefill got an unexpected keyword argument {unknown[0]!r}")
        self._check_call(kv_cache, enable_trace)
        tokens, page_table = _cast(tokens, torch.int64), _cast(page_table, torch.int32)
        prompt_lens, start_pos = _cast(prompt_lens, torch.int64), _cast(start_pos, torch.int64)
        num_rows = _num_rows(tokens)
        if prompt_lens is None:
            prompt_lens = [len(row) for row in tokens]
        mode = "traced" if enable_trace else "eager"
        target = self.lanes.target()
        plan = self._plan_keywords(compatibility_kwargs, page_table, prompt_lens, num_rows)
        if pooling is not None:
            lengths = _cast(pooling_prompt_lens, torch.int64)
            sampled = sampling_params is not None
            rows = pooled_rows(self.pooling_head, pooling, lengths, prompt_lens, start_pos, num_rows, sampled)
            results = target.prefill(
                tokens, page_table, prompt_lens, start_pos, empty_slots, None, mode=mode, pooling=rows.types, **plan
            )
            return pooler_output(results, rows, self.pooling_head)
        if pooling_prompt_lens is not None:
            msg = "pooling_prompt_lens is invalid without pooling: it says which pooled rows a step completes"
            raise InvalidPoolingError(msg, field="pooling_prompt_lens")
        if sampling_params is None:
            out = target.prefill(
                tokens, page_table, prompt_lens, start_pos, empty_slots, None, mode=mode, batched=True, **plan
            )
            return out.logits.unsqueeze(1)  # [B, 1, V]
        plugin = rows_from_plugin(sampling_params, num_rows, self.model.spec.vocab_size)
        prompts, outputs = self._penalty_state(compatibility_kwargs, tokens, prompt_lens, empty_slots, plugin)
        out = target.prefill(
            tokens, page_table, prompt_lens, start_pos, empty_slots, plugin.core, mode=mode, batched=True, **plan
        )
        return self._sampled(out, plugin, prompts, outputs)

    def _plan_keywords(self, kwargs: dict, page_table, prompt_lens, num_rows: int) -> dict:
        """Planning keywords a call adds to the prefill: none here (a hybrid model's tables: ``hybrid_facade``).

        Every layer reads and writes through ``page_table``, so a
        ``page_tables_per_layer`` must map each row's blocks as it does, on
        every layer; any other is a ``PrefillInputError`` naming the layer and
        row, before anything runs (writing a layer through another table
        would change blocks other requests own).
        """
        tables = kwargs.get("page_tables_per_layer")
        if tables is not None:
            _check_same_tables(tables, page_table, prompt_lens, num_rows, self.model.spec.num_layers, self._blocks())
        return {}

    def _blocks(self) -> int:
        """The block size of the lanes' layout (every lane's is one)."""
        return self.lanes.executors()[0].runtime.config.layout.block_size

    def _penalty_state(self, kwargs: dict, tokens, prompt_lens, empty_slots, plugin: PluginRows):
        """Each penalised row's prompt and output ids (``penalty_state``), checked before anything runs."""
        capacity = self.max_batch_size
        slots = list(range(len(tokens))) if empty_slots is None else list(empty_slots)
        check_slot_remap(kwargs.get("slot_remap"), capacity)
        given_prompts = state_rows(kwargs.get("prompt_tokens"), "prompt_tokens", slots, capacity)
        given_outputs = state_rows(kwargs.get("output_tokens"), "output_tokens", slots, capacity)
        lengths = prompt_lens.tolist() if isinstance(prompt_lens, torch.Tensor) else list(prompt_lens)
        vocab = self.model.spec.vocab_size
        prompts, outputs = {}, {}
        for row in plugin.penalised:
            if given_prompts is None:
                prompts[row] = torch.as_tensor(tokens[row][: lengths[row]], dtype=torch.int64)
            else:
                prompts[row] = token_ids(given_prompts[row], "prompt_tokens", row, vocab)
            none = torch.zeros(0, dtype=torch.int64)
            outputs[row] = none if given_outputs is None else token_ids(given_outputs[row], "output_tokens", row, vocab)
        return prompts, outputs

    def _sampled(self, out: BatchResult, plugin: PluginRows, prompts: dict, outputs: dict):
        """``(tokens, log_probs)`` from the call's tensors; penalised rows are sampled here from their logits."""
        sampled, logprobs = out.tokens, out.logprobs
        for row in plugin.penalised:
            sampling = plugin.rows[row]
            seed = sampling.params.seed
            seed = self._rng.getrandbits(63) if seed is None else seed
            sampled[row], logprobs[row] = sample_penalised(
                out.logits[row], prompts[row], outputs[row], sampling.penalties, sampling.params, seed
            )
        if not plugin.logprob_rows:
            return sampled, None
        log_probs = torch.ones(len(plugin.rows), dtype=torch.float32)
        log_probs[plugin.logprob_rows] = logprobs[plugin.logprob_rows]
        return sampled, log_probs

    def _check_call(self, kv_cache: Any, enable_trace: Any) -> None:
        if not isinstance(enable_trace, bool):
            raise TypeError("enable_trace must be bool")
        if enable_trace and not self.prefill_traces:
            raise PrefillConfigError("enable_trace=True for prefill disagrees with this facade: prefill traces are off")
        self.lanes.executors()  # nothing runs before allocate_kv_cache
        self.lanes.check_kv(kv_cache)

    def cleanup(self) -> None:
        """Releases traces, workspaces and orphans; a later call needs ``allocate_kv_cache`` again."""
        self._release()

    def _release(self) -> None:
        """Closes every lane (their pools' traces and workspaces go with them); the next call needs new pools."""
        self.lanes.release()
        self.kv = None


class OneLane:
    """The lane of a ``ServingFacade``: one executor over one pool, built by ``kv_factory``."""

    def __init__(self, model: PrefillModel, backend: Backend, kv_factory, max_batch_size: int, seed: int):
        self.model = model
        self.backend = backend
        self.pool_rows = max_batch_size  # slots the lane holds; a provisional pool holds a block of tail for each
        self._kv_factory = kv_factory
        # pool_factory(model, num_blocks, block_size): how a KV-group facade builds each lane's pool.
        self.pool_factory: Callable[[Any, int, int], Any] | None = None
        self._seed = seed
        self.executor: PrefillExecutor | None = None

    def regroup(self, regrouped: Callable[[Any], Any]) -> None:
        """Replaces the lane's model by ``regrouped(model)`` (a KV-group facade at allocation)."""
        self.model = regrouped(self.model)

    @property
    def lane_models(self) -> tuple:
        """The one ``(model, backend)`` pair, as a lane group lists its lanes."""
        return ((self.model, self.backend),)

    @property
    def built(self) -> bool:
        return self.executor is not None

    def executors(self) -> list[PrefillExecutor]:
        if self.executor is None:
            raise PrefillStateError("call allocate_kv_cache before any prefill: no KV pool is allocated yet")
        return [self.executor]

    def target(self) -> PrefillExecutor:
        """What runs a normalised call (``PrefillExecutor.prefill``'s signature, ``batched`` included)."""
        return self.executors()[0]

    def build(self, num_blocks: int, block_size: int, lane_executor) -> Any:
        """Builds the pool and the executor over it; returns the pool (what the plugin passes back as ``kv_cache``)."""
        if self.pool_factory is not None:
            kv = self.pool_factory(self.model, num_blocks, block_size)
        elif self._kv_factory is not None:
            kv = self._kv_factory(num_blocks, block_size)
        else:
            kv = self.model.new_kv_cache(num_blocks, block_size)
        self.executor = lane_executor(self.model, self.backend, kv, num_blocks, block_size, self._seed)
        return kv

    def release(self) -> None:
        if self.executor is not None:
            self.executor.close()
        self.executor = None

    def check_kv(self, kv_cache: Any) -> None:
        if kv_cache is not None and kv_cache is not self.target().runtime.config.kv:
            msg = (
                f"kv_cache={type(kv_cache).__name__} is invalid: it must be the pool allocate_kv_cache returned "
                "(the one this runtime was resolved with), or None"
            )
            raise KVCacheMismatchError(msg, field="kv_cache")


class ServingFacade(PluginFacade):
    """``prefill_forward`` and its set-up calls, as the plugin makes them, over one runtime lane.

    ``kv_factory(num_blocks, block_size)`` builds a KV pool (default: the
    model's ``new_kv_cache``); the pool is built by ``allocate_kv_cache``,
    at vLLM's block size, so nothing runs before it. ``max_batch_size`` is
    vLLM's ``max_num_seqs``: the lane's slots (the runtime's
    ``policy.lane_size`` is set to it), so an ``empty_slots`` entry at or
    past it is an ``InvalidSlotError`` at its row. ``warmup_lengths`` limits
    both warm-up phases to those invocation lengths (tt-transformers'
    ``WarmupConfig.prefill_seq_lens``; ``prefill_core.calls.warmup.limited_to``):
    a traced call of another length is then a ``TraceCoverageError``. ``kv_dtype`` is None or
    the model's dtype (the pool is built in it and the model runs on it);
    any other is a ``PrefillConfigError`` here, before any pool exists.
    ``pooler`` (a ``PoolerConfig``) and ``score`` (its classification head,
    where it has one) let ``prefill_forward`` take pooling requests; a
    ``PoolingFolder`` from ``load_pooling_folder`` holds both.
    """

    def __init__(
        self,
        model: PrefillModel,
        backend: Backend,
        *,
        max_seq_len: int,
        max_batch_size: int = 32,
        policy: PrefillPolicy | None = None,
        kv_factory: Callable[[int, int], Any] | None = None,
        kv_dtype: torch.dtype | None = None,
        prefill_traces: bool = True,
        warmup_lengths: Sequence[int] | None = None,
        seed: int = 0,
        pooler: Any = None,
        score: torch.Tensor | None = None,
    ):
        lane = OneLane(model, backend, kv_factory, max_batch_size, seed)
        super().__init__(
            lane,
            max_seq_len=max_seq_len,
            max_batch_size=max_batch_size,
            policy=policy,
            kv_dtype=kv_dtype,
            prefill_traces=prefill_traces,
            seed=seed,
            warmup_lengths=warmup_lengths,
            pooler=pooler,
            score=score,
        )

    @property
    def executor(self) -> PrefillExecutor | None:
        """The lane's executor (None before ``allocate_kv_cache`` and after ``cleanup``)."""
        return self.lanes.executor

    @property
    def runtime(self) -> PrefillRuntime:
        return self.lanes.target().runtime


def _from_numpy(value):
    """A numpy integer array as a tensor: the plugin builds ``prompt_lens`` and ``start_pos`` with numpy.

    Only the dtypes the runtime takes as tensors (signed ints, uint8); anything
    else, a float or uint64 array included, is returned as it is for the
    runtime to name. numpy is not imported here: an array is known by its module.
    """
    dtype = getattr(value, "dtype", None)
    if type(value).__module__ != "numpy" or dtype is None:
        return value
    if dtype.kind == "i" or dtype.kind == "u" and dtype.itemsize == 1:
        return torch.as_tensor(value.copy())  # a copy is C-contiguous: torch refuses negative strides
    return value


def _cast(value, dtype: torch.dtype):
    """An integer tensor (or numpy integer array) cast to ``dtype`` (as the adapter does); anything else as it is.

    A tensor holding a value ``dtype`` cannot (an int64 block id past int32)
    stays as it is too: the cast would wrap it onto another value, which the
    runtime would then take for the caller's.
    """
    value = _from_numpy(value)
    if not isinstance(value, torch.Tensor) or value.dtype is dtype:
        return value
    if value.is_floating_point() or value.is_complex() or value.dtype is torch.bool:
        return value
    if value.layout is not torch.strided or value.is_meta:
        return value  # no dense data to cast: the runtime names it
    if value.dtype is torch.int64 and dtype is torch.int32 and value.numel():
        low, high = (int(v) for v in torch.aminmax(value))
        if low < torch.iinfo(dtype).min or high > torch.iinfo(dtype).max:
            return value
    return value.to(dtype)


def _int_list(value, default: list[int]) -> list[int] | None:
    """One int per row from a 1-D integer tensor or a sequence of ints (``default`` for None); None otherwise."""
    if value is None:
        return default
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype is torch.bool:
            return None
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or any(type(v) is not int for v in value) or len(value) != len(default):
        return None
    return list(value)


def _check_same_tables(tables, page_table, prompt_lens, num_rows: int, num_layers: int, block_size: int) -> None:
    """Each layer's table maps each row's blocks (``ceil(prompt_len / block_size)`` columns) as ``page_table``."""
    pointer = "; a model in several KV groups is served by prefill_shell.serving.hybrid_facade.HybridServingFacade"
    if not isinstance(tables, (list, tuple)) or len(tables) != num_layers:
        got = f"{len(tables)} tables" if isinstance(tables, (list, tuple)) else type(tables).__name__
        msg = f"page_tables_per_layer={got} is invalid: one table per layer ({num_layers}), each equal to page_table"
        raise PrefillInputError(msg + pointer, field="page_tables_per_layer")
    lengths = _int_list(prompt_lens, [0] * num_rows)
    plain = _cast(page_table, torch.int32)
    if lengths is None or not isinstance(plain, torch.Tensor) or plain.dim() != 2 or len(plain) < num_rows:
        return  # the runtime names the malformed prompt_lens or page_table before anything runs
    for layer, table in enumerate(tables):
        table = _cast(table, torch.int32)
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] < num_rows:
            msg = f"page_tables_per_layer[{layer}] is invalid: must be a 2-D integer tensor of at least {num_rows} rows"
            raise PrefillInputError(msg, field=f"page_tables_per_layer[{layer}]")
        for row in range(num_rows):
            need = ceil_div(max(lengths[row], 0), block_size)
            mine, theirs = table[row, :need], plain[row, :need]
            if not torch.equal(mine, theirs):
                msg = (
                    f"page_tables_per_layer[{layer}] row {row} is invalid: it maps blocks {mine.tolist()}, "
                    f"page_table {theirs.tolist()}; every layer of this model reads and writes page_table's blocks"
                )
                raise PrefillInputError(msg + pointer, field=f"page_tables_per_layer[{layer}]", row=row)


def _kv_heads_per_device(num_kv_heads: int, num_devices: int) -> int:
    """The KV heads vLLM's plugin puts in ``kv_cache_shape`` for a lane of ``num_devices`` devices.

    The plugin divides the model's KV heads over the lane's devices (tensor
    parallel: each device holds its share), never below one head.
    """
    return num_kv_heads // min(max(int(num_devices), 1), num_kv_heads)


def _num_rows(tokens) -> int:
    """The call's row count; tokens that are not rows (a 0-d or 1-d tensor, a number) get the runtime's named error."""
    if not hasattr(tokens, "__len__") or isinstance(tokens, torch.Tensor) and tokens.dim() != 2:
        as_token_matrix(tokens)  # raises the PrefillInputError naming tokens
    return len(tokens)
