"""The Tenstorrent plugin's model runner (e3fc8494, ``model_runner.py``) around vLLM's real scheduler, prefill only.

Per step, as the runner does it: ``scheduler.schedule()``; new requests'
block ids recorded, cached requests' ``new_block_ids`` appended (a resumed
request's replace them; vLLM 0.33 names a preempted request in
``preempted_req_ids`` and sends it back as a new request); ``_prepare_model_inputs``' tokens, ``prompt_lens``
(computed + scheduled) and ``start_pos`` (computed); ``page_table`` group
0's block ids; ``_block_tables_per_layer``: each layer its group's table as
a fresh ``[max_num_seqs, max_blocks]`` zero-padded tensor, passed only when
there are several groups (``submit_prefill``); then ``ModelRunnerOutput``
and ``update_from_output``. A request whose prefill completes samples one
token (``max_tokens=1``) and finishes.

Each step is also checked: no KV byte outside the blocks the step writes
(each row's blocks covering its scheduled positions, every group) changes;
each finished request's last-token logits and the KV of the positions its
layers keep equal transformers' one-shot forward of its prompt. Statistics
(prefix hits, window frees, stale entries at other live requests' blocks)
are counted from vLLM's own managers.

A step is the runner's phases (``schedule``, ``prepare``, the call,
``collect``, ``update``), so ``DataParallelRunner`` runs one
``PluginRunner`` per data-parallel rank and gathers their rows into one
call, as the plugin's runner does under vLLM data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.outputs import ModelRunnerOutput

from prefill_core.values.intmath import ceil_div
from tests.vllm.checkpoints import BLOCK

TOL = 1e-4


@dataclass
class Stats:
    steps: int = 0
    finished: int = 0
    prefix_hit_tokens: int = 0
    window_frees: int = 0  # distinct table entries of blocks vLLM freed below a window (the runner keeps the ids)
    stale_at_live_blocks: int = 0  # distinct such entries sent while another live request held the block
    preemptions: int = 0
    worst_logits: float = 0.0
    worst_kv: float = 0.0
    kv_checked: int = 0


@dataclass
class Live:
    prompt: torch.Tensor
    blocks: list[list[int]] = field(default_factory=list)  # per group, appended as the runner appends
    computed: int = 0


@dataclass
class Prepared:
    """One rank's share of a step: its rows' inputs and the bytes of every block the step must leave alone."""

    rows: list[str]
    starts: list[int]
    ends: list[int]
    tokens: torch.Tensor  # [rows, max(ends)]
    tables: list[torch.Tensor]  # per group, [max_num_seqs, max_blocks]
    written: set[int]  # the blocks the step writes (each row's blocks over its scheduled positions, every group)
    before: dict[int, torch.Tensor]


class PluginRunner:
    def __init__(self, facade, kv, scheduler, oracle, *, enable_trace: bool, max_num_seqs: int, max_blocks: int):
        self.facade, self.kv, self.scheduler, self.oracle = facade, kv, scheduler, oracle
        self.enable_trace, self.max_num_seqs, self.max_blocks = enable_trace, max_num_seqs, max_blocks
        self.live: dict[str, Live] = {}
        self.slots: dict[str, int] = {}  # req id -> its persistent batch slot (InputBatch's index)
        self.stats = Stats()
        self._freed: set[tuple] = set()
        self._stale: set[tuple] = set()
        self.num_groups = len(scheduler.kv_cache_config.kv_cache_groups)
        self.groups = scheduler.kv_cache_config.kv_cache_groups
        self.num_layers = facade.model.spec.num_layers
        self.group_of_layer = {}
        for g, group in enumerate(getattr(facade.model, "attention", None).groups if self.num_groups > 1 else ()):
            for layer in group.layers:
                self.group_of_layer[layer] = g

    def add(self, request) -> None:
        self.live[request.request_id] = Live(torch.tensor(request.prompt_token_ids, dtype=torch.int64))
        self.scheduler.add_request(request)

    def run(self, max_steps: int = 200) -> Stats:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return self.stats
            self.step()
        raise AssertionError(f"vLLM still has requests after {max_steps} steps (a request it can never schedule?)")

    # -- one step ---------------------------------------------------------
    def step(self) -> None:
        out, rows = self.schedule()
        sampled = []
        if rows:
            call = self.prepare(rows, out.num_scheduled_tokens)
            logits = self.facade.prefill_forward(
                call.tokens,
                call.tables[0][: len(rows)],
                enable_trace=self.enable_trace,
                prompt_lens=torch.tensor(call.ends),
                start_pos=torch.tensor(call.starts),
                kv_cache=self.kv,
                **self.per_layer_kwargs(call.tables),
            )
            sampled = self.collect(call, logits)
        self.update(out, rows, sampled)

    def schedule(self):
        """``scheduler.schedule()`` and the runner's request states: ``(scheduler output, scheduled req ids)``,
        new requests first, then cached ones (vLLM's order); each row holds a persistent batch slot."""
        out = self.scheduler.schedule()
        self.stats.steps += 1
        self.stats.preemptions += len(out.preempted_req_ids or ())
        for req_id in out.preempted_req_ids or ():
            self.slots.pop(req_id, None)  # the runner drops a preempted request from its persistent batch
        for new in out.scheduled_new_reqs:
            state = self.live[new.req_id]
            state.blocks = [list(ids) for ids in new.block_ids]
            state.computed = new.num_computed_tokens
            self.stats.prefix_hit_tokens += new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.live[req_id]
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.blocks = [list(g) for g in ids]
            elif ids is not None:
                for g, more in enumerate(ids):
                    state.blocks[g].extend(more)
            state.computed = cached.num_computed_tokens[i]
        rows = [r.req_id for r in out.scheduled_new_reqs] + list(cached.req_ids)
        for req_id in rows:
            if req_id not in self.slots:  # InputBatch.add_request: the lowest free slot
                self.slots[req_id] = min(set(range(self.max_num_seqs)) - set(self.slots.values()))
        return out, rows

    def prepare(self, rows, scheduled) -> Prepared:
        """The step's inputs for ``rows`` (``_prepare_model_inputs``) and a snapshot of every block it leaves."""
        starts = [self.live[r].computed for r in rows]
        ends = [s + scheduled[r] for s, r in zip(starts, rows)]
        tokens = torch.zeros(len(rows), max(ends), dtype=torch.int64)
        for i, r in enumerate(rows):
            tokens[i, : ends[i]] = self.live[r].prompt[: ends[i]]
        tables = [self._group_table(rows, g) for g in range(self.num_groups)]
        written = self._written(rows, starts, ends)
        self._count_stale(rows, starts)
        before = {b: self.kv.block_bytes(b) for b in range(self.kv.num_blocks) if b not in written}
        return Prepared(rows, starts, ends, tokens, tables, written, before)

    def per_layer_kwargs(self, tables) -> dict:
        """``submit_prefill``'s ``page_tables_per_layer``: each layer its group's fresh table, several groups only."""
        if self.num_groups == 1:
            return {}
        return {
            "page_tables_per_layer": [tables[self.group_of_layer[layer]].clone() for layer in range(self.num_layers)]
        }

    def collect(self, call: Prepared, logits) -> list[list[int]]:
        """Checks the pool outside the step's writes and each finished row; ``sampled_token_ids`` of ``rows``."""
        for block, old in call.before.items():
            assert torch.equal(self.kv.block_bytes(block), old), f"block {block} changed outside the step's writes"
        sampled = []
        for i, r in enumerate(call.rows):
            state = self.live[r]
            if call.ends[i] < len(state.prompt):
                sampled.append([])
                continue
            self._check_finished(state, logits[i, 0])
            sampled.append([int(logits[i, 0].argmax())])
            self.stats.finished += 1
        return sampled

    def update(self, out, rows, sampled) -> None:
        """``ModelRunnerOutput`` of ``rows`` to ``update_from_output``; finished requests leave the batch."""
        runner_out = ModelRunnerOutput(
            req_ids=rows, req_id_to_index={r: i for i, r in enumerate(rows)}, sampled_token_ids=sampled
        )
        self.scheduler.update_from_output(out, runner_out)
        for req_id in list(self.live):
            if req_id in out.finished_req_ids or self.scheduler.requests.get(req_id) is None:
                del self.live[req_id]
                self.slots.pop(req_id, None)

    def _group_table(self, rows, g: int) -> torch.Tensor:
        """``_block_tables_per_layer``'s table of group g: ``[max_num_seqs, max_blocks]``, zero padded."""
        table = torch.zeros(self.max_num_seqs, self.max_blocks, dtype=torch.int32)
        for i, r in enumerate(rows):
            ids = self.live[r].blocks[g]
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return table

    def _written(self, rows, starts, ends) -> set[int]:
        out = set()
        for r, s, e in zip(rows, starts, ends):
            for ids in self.live[r].blocks:
                out.update(ids[c] for c in range(s // BLOCK, ceil_div(e, BLOCK)))
        return out

    def _manager_blocks(self, req_id: str, g: int) -> list[int]:
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[g]
        return [b.block_id for b in manager.req_to_blocks.get(req_id, [])]

    def _count_stale(self, rows, starts) -> None:
        """Window frees (blocks vLLM freed below a window while the runner's table keeps their ids) and those of
        them now held by another live request, in any group."""
        held = {}
        for other in self.live:
            for g in range(self.num_groups):
                for b in self._manager_blocks(other, g):
                    if b != 0:
                        held.setdefault(b, set()).add(other)
        for r in rows:
            for g in range(self.num_groups):
                current = self._manager_blocks(r, g)
                for c, b in enumerate(self.live[r].blocks[g]):
                    if c < len(current) and current[c] != b and current[c] == 0:
                        self._freed.add((r, g, c))
                        if held.get(b, set()) - {r}:
                            self._stale.add((r, g, c, b))
        self.stats.window_frees, self.stats.stale_at_live_blocks = len(self._freed), len(self._stale)

    def _check_finished(self, state: Live, logits: torch.Tensor) -> None:
        with torch.no_grad():
            out = self.oracle(state.prompt[None], use_cache=True)
        expected = out.logits[0, -1]
        diff = float((logits - expected).abs().max())
        self.stats.worst_logits = max(self.stats.worst_logits, diff)
        assert diff <= TOL * max(1.0, float(expected.abs().max())), f"logits differ by {diff}"
        n = len(state.prompt)
        for layer, cache in enumerate(out.past_key_values.layers):
            keys, values = cache.keys[0], cache.values[0]  # [H_kv, kept, D]
            kept = keys.shape[1]
            pool, local, _, g = self._pool_of(layer)
            blocks = state.blocks[g]
            for j, p in enumerate(range(n - kept, n)):
                block = blocks[p // BLOCK]
                k = pool.keys[local][block, :, p % BLOCK]
                v = pool.values[local][block, :, p % BLOCK]
                worst = max(float((k - keys[:, j]).abs().max()), float((v - values[:, j]).abs().max()))
                self.stats.worst_kv = max(self.stats.worst_kv, worst)
                assert worst <= TOL, f"layer {layer} position {p}: KV differs by {worst}"
            self.stats.kv_checked += kept

    def _pool_of(self, layer: int):
        if hasattr(self.kv, "of_layer"):
            return self.kv.of_layer(layer)
        return self.kv, layer, None, 0


class DataParallelRunner:
    """The plugin's runner under vLLM data parallelism: each DP rank its own scheduler and KV cache manager (a
    ``PluginRunner`` over its lane's pool), every step's rows of all ranks gathered into ONE ``prefill_forward``.

    Rank by rank in the call: ``empty_slots = dp_rank * max_num_seqs + slot`` (the row's persistent batch
    slot on its rank), each group's table the ranks' rows stacked (each in its own pool's block ids, padded
    to ``ranks * max_num_seqs`` rows), ``kv_cache`` the lanes' pools; each rank's rows (logits, checks,
    ``ModelRunnerOutput``) go back to its own scheduler. ``shared_id_steps`` counts the calls in which two
    ranks wrote a block of the same id (each in its own lane's pool).
    """

    def __init__(self, facade, pools, schedulers, oracle, *, enable_trace: bool, max_num_seqs: int, max_blocks: int):
        assert len(pools) == len(schedulers)
        self.facade, self.pools, self.enable_trace = facade, list(pools), enable_trace
        self.max_num_seqs, self.max_blocks = max_num_seqs, max_blocks
        self.ranks = [
            PluginRunner(
                facade,
                kv,
                scheduler,
                oracle,
                enable_trace=enable_trace,
                max_num_seqs=max_num_seqs,
                max_blocks=max_blocks,
            )
            for kv, scheduler in zip(pools, schedulers)
        ]
        self.calls = self.all_rank_calls = self.shared_id_steps = 0

    def add(self, rank: int, request) -> None:
        self.ranks[rank].add(request)

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not any(rank.scheduler.has_requests() for rank in self.ranks):
                return
            self.step()
        raise AssertionError(f"vLLM still has requests after {max_steps} steps (a request it can never schedule?)")

    def step(self) -> None:
        scheduled = [rank.schedule() for rank in self.ranks]
        calls = [
            rank.prepare(rows, out.num_scheduled_tokens) if rows else None
            for rank, (out, rows) in zip(self.ranks, scheduled)
        ]
        present = [(k, call) for k, call in enumerate(calls) if call is not None]
        sampled = [[] for _ in self.ranks]
        if present:
            logits = self._forward(present)
            offset = 0
            for k, call in present:
                sampled[k] = self.ranks[k].collect(call, logits[offset : offset + len(call.rows)])
                offset += len(call.rows)
        for rank, (out, rows), rank_sampled in zip(self.ranks, scheduled, sampled):
            rank.update(out, rows, rank_sampled)

    def _forward(self, present) -> torch.Tensor:
        self.calls += 1
        self.all_rank_calls += len(present) == len(self.ranks)
        written = [call.written for _, call in present]
        self.shared_id_steps += any(a & b for i, a in enumerate(written) for b in written[i + 1 :])
        width = max(call.tokens.shape[1] for _, call in present)
        tokens = torch.cat(
            [torch.nn.functional.pad(call.tokens, (0, width - call.tokens.shape[1])) for _, call in present]
        )
        tables = []
        for g in range(self.ranks[0].num_groups):
            table = torch.zeros(len(self.ranks) * self.max_num_seqs, self.max_blocks, dtype=torch.int32)
            rows = torch.cat([call.tables[g][: len(call.rows)] for _, call in present])
            table[: len(rows)] = rows
            tables.append(table)
        slots = [k * self.max_num_seqs + self.ranks[k].slots[r] for k, call in present for r in call.rows]
        return self.facade.prefill_forward(
            tokens,
            tables[0][: len(tokens)],
            enable_trace=self.enable_trace,
            prompt_lens=torch.tensor([e for _, call in present for e in call.ends]),
            start_pos=torch.tensor([s for _, call in present for s in call.starts]),
            empty_slots=slots,
            kv_cache=self.pools,
            **self.ranks[0].per_layer_kwargs(tables),
        )
