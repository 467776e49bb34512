"""A small vLLM-like scheduler: the test client that drives ``ServingFacade.prefill_forward`` step after step.

What it keeps from vLLM's v1 scheduler (prefill only):

* a token budget per step: running requests first, in admission order, then
  arrived waiting ones while the budget and ``max_num_seqs`` allow; a
  chunk ends wherever the budget does, so starts land inside blocks;
* a block pool with reference counts and a prefix cache keyed by chained
  block hashes; a block is registered when it is allocated for the step
  that fills it (before that step runs), so a request admitted later in the
  same step can map it as cached; a hit stops one token short of the prompt
  (the last token is always computed); freed blocks keep their hash until
  they are reused;
* decoding requests keep their blocks: after its prefill a request stays
  running for ``decode_steps`` steps, one token of budget and one more KV
  position each (no prefill call; its output is not modelled);
* preemption: when blocks run out, the last admitted running request frees
  its blocks and goes back to the front of the queue, to be recomputed (its
  cached blocks may then hit).

Each step is one ``prefill_forward`` call with the plugin's keywords:
``prompt_lens`` = computed + chunk, ``start_pos`` = computed, full token rows.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class SimRequest:
    """One prompt and its scheduling state."""

    id: int
    tokens: torch.Tensor  # int64 [n]
    arrival: int
    seed: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    slot: int = -1
    decoded: int = 0
    results: list = field(default_factory=list)  # one per completed prefill (a preempted request completes again)
    preemptions: int = 0


class BlockPool:
    """Reference-counted blocks with a prefix cache by chained block hash (block 0 is never handed out)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free: deque[int] = deque(range(1, num_blocks))  # reused from the left: least recently freed first
        self.ref = dict.fromkeys(range(num_blocks), 0)
        self.hash_of: dict[int, int] = {}
        self.by_hash: dict[int, int] = {}

    def hashes(self, tokens: torch.Tensor, count: int) -> list[int]:
        """Chained hashes of the first ``count`` full blocks."""
        out, parent = [], 0
        for j in range(count):
            parent = hash((parent, tuple(tokens[j * self.block_size : (j + 1) * self.block_size].tolist())))
            out.append(parent)
        return out

    def lookup(self, tokens: torch.Tensor, max_tokens: int) -> list[int]:
        """Cached blocks of the longest prefix of whole blocks within ``max_tokens``."""
        hits = []
        for h in self.hashes(tokens, max_tokens // self.block_size):
            if h not in self.by_hash:
                break
            hits.append(self.by_hash[h])
        return hits

    def take(self, block: int) -> None:
        if self.ref[block] == 0:
            self.free.remove(block)
        self.ref[block] += 1

    def allocate(self) -> int | None:
        if not self.free:
            return None
        block = self.free.popleft()
        old = self.hash_of.pop(block, None)
        if old is not None and self.by_hash.get(old) == block:
            del self.by_hash[old]  # evicted from the prefix cache
        self.ref[block] = 1
        return block

    def register(self, block: int, h: int) -> None:
        if h not in self.by_hash:
            self.by_hash[h] = block
            self.hash_of[block] = h

    def release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)


class Scheduler:
    """Token-budget chunked prefill over a ``BlockPool``; ``step`` returns ``[(request, chunk length)]``."""

    def __init__(
        self, requests: list[SimRequest], pool: BlockPool, *, budget: int, max_num_seqs: int, decode_steps: int = 0
    ):
        self.pool, self.budget, self.max_num_seqs, self.decode_steps = pool, budget, max_num_seqs, decode_steps
        self.waiting: deque[SimRequest] = deque(sorted(requests, key=lambda r: r.arrival))
        self.running: list[SimRequest] = []
        self.slots = list(range(max_num_seqs))
        self.stats = {"preemptions": 0, "prefix_hit_blocks": 0, "same_step_hits": 0, "unaligned_starts": 0}
        self._written_this_step: set[int] = set()

    def step(self, now: int) -> list[tuple[SimRequest, int]]:
        self._written_this_step = set()
        scheduled, budget = [], self.budget
        for request in list(self.running):
            if budget == 0 or request not in self.running:
                continue
            if request.computed == len(request.tokens):
                budget -= self._decode(request)
                continue
            n = min(len(request.tokens) - request.computed, budget)
            while not self._grow(request, request.computed + n):
                self._preempt(self.running[-1])
                if request not in self.running:
                    break
            if request in self.running:
                scheduled.append((request, n))
                budget -= n
        while self.waiting and self.waiting[0].arrival <= now and budget and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self._admit(request, budget):
                break
            self.waiting.popleft()
            n = min(len(request.tokens) - request.computed, budget)
            scheduled.append((request, n))
            budget -= n
        bs = self.pool.block_size
        self.stats["unaligned_starts"] += sum(1 for r, _ in scheduled if r.computed % bs)
        return scheduled

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def prefilled(self, request: SimRequest) -> None:
        """The request's prompt is all computed: it decodes from the next step, or finishes."""
        if self.decode_steps == 0:
            self._finish(request)

    def _decode(self, request: SimRequest) -> int:
        """One decode step of ``request`` (one more KV position); the budget it took."""
        while not self._grow(request, len(request.tokens) + request.decoded + 1):
            self._preempt(self.running[-1])
            if request not in self.running:
                return 0
        request.decoded += 1
        if request.decoded >= self.decode_steps:
            self._finish(request)
        return 1

    def _finish(self, request: SimRequest) -> None:
        self._free(request)
        self.running.remove(request)

    def _admit(self, request: SimRequest, budget: int) -> bool:
        hits = self.pool.lookup(request.tokens, len(request.tokens) - 1)
        for block in hits:
            self.pool.take(block)
        request.blocks, request.computed = list(hits), len(hits) * self.pool.block_size
        n = min(len(request.tokens) - request.computed, budget)
        if not self._grow(request, request.computed + n):
            self._free(request)
            return False
        self.stats["prefix_hit_blocks"] += len(hits)
        self.stats["same_step_hits"] += len(set(hits) & self._written_this_step)
        request.slot = self.slots.pop(0)
        self.running.append(request)
        return True

    def _grow(self, request: SimRequest, upto: int) -> bool:
        """Blocks for ``upto`` tokens; registers every block full after this step (vLLM: at allocation)."""
        bs = self.pool.block_size
        need = -(-upto // bs)
        new = []
        while len(request.blocks) + len(new) < need:
            block = self.pool.allocate()
            if block is None:
                for b in new:
                    self.pool.release(b)
                return False
            new.append(block)
        request.blocks += new
        if request.computed == len(request.tokens):
            return True  # a decode position: nothing of the prompt is written or registered
        first_written = request.computed // bs
        self._written_this_step.update(request.blocks[first_written:need])
        for j, h in enumerate(self.pool.hashes(request.tokens, min(upto, len(request.tokens)) // bs)):
            if j >= first_written:
                self.pool.register(request.blocks[j], h)
        return True

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.preemptions += 1
        self.stats["preemptions"] += 1

    def _free(self, request: SimRequest) -> None:
        for block in request.blocks:
            self.pool.release(block)
        request.blocks, request.computed, request.decoded = [], 0, 0
        if request.slot >= 0:
            self.slots.append(request.slot)
            request.slot = -1


def _own_blocks(scheduled, block_size: int) -> set[int]:
    """The blocks a step writes: each row's, from the block holding its start to its chunk's end."""
    own = set()
    for request, n in scheduled:
        end = request.computed + n
        own.update(request.blocks[request.computed // block_size : -(-end // block_size)])
    return own


def drive(facade, scheduler: Scheduler, *, traced: bool, sampling=None, seed: int = 0, max_steps: int = 1000) -> None:
    """Runs ``scheduler`` to idle, one ``prefill_forward`` per step with the plugin's keywords.

    ``sampling(rows)`` builds the step's sampling parameters (None: logits).
    A request's result (its final-chunk logits ``[V]``, or ``(token,
    log-prob)``) is appended when its prefill completes. After every step,
    no byte of the pool outside the step's own blocks (and the write-only
    sink) may have changed.
    """
    kv, rng, bs = facade.kv, random.Random(seed), scheduler.pool.block_size
    width = facade.runtime.config.layout.max_num_blocks_per_seq
    for now in range(max_steps):
        if scheduler.idle:
            return
        scheduled = scheduler.step(now)
        if not scheduled:
            continue
        rng.shuffle(scheduled)  # the plugin's row order is its persistent batch's, not the scheduling order
        rows = [r for r, _ in scheduled]
        tokens = torch.zeros(len(rows), max(len(r.tokens) for r in rows), dtype=torch.int64)
        table = torch.full((len(rows), width), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.tokens)] = r.tokens
            table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        before = [t.clone() for t in kv.keys + kv.values]
        out = facade.prefill_forward(
            tokens,
            table,
            kv_cache=kv,
            enable_trace=traced,
            prompt_lens=torch.tensor([r.computed + n for r, n in scheduled]),
            start_pos=torch.tensor([r.computed for r in rows]),
            empty_slots=[r.slot for r in rows],
            sampling_params=None if sampling is None else sampling(rows),
        )
        own = _own_blocks(scheduled, bs) | {kv.sink_block}  # the sink absorbs -1 writes; no row maps it
        for old, new in zip(before, kv.keys + kv.values):
            changed = (old != new).reshape(old.shape[0], -1).any(1).nonzero().flatten().tolist()
            assert set(changed) <= own, f"step {now}: blocks {sorted(set(changed) - own)} changed"
        for i, (r, n) in enumerate(scheduled):
            r.computed += n
            if r.computed == len(r.tokens):
                r.results.append(out[i, 0].clone() if sampling is None else (int(out[0][i]), float(out[1][i])))
                scheduler.prefilled(r)
    raise AssertionError(f"the scheduler is not idle after {max_steps} steps")
