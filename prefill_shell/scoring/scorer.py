"""Scoring: the log-likelihood of continuations given contexts, and of whole documents.

``Scorer.score(pairs)`` takes ``(context, continuation)`` token-id pairs.
Pairs are grouped by their contexts' shared whole blocks with the CLI's
prefix sharing (``prefix_sharing``); each group's shared blocks are
prefilled once, and each continuation then runs as a follow-up row that

* maps the shared blocks read-only (its cached offset: the shared length,
  never past ``len(context) - 1``, so it is at most the context length
  rounded down to a block multiple),
* maps private blocks of its own from that column on (so the context's last,
  partly filled block is recomputed in the row's own block: no block another
  row maps is ever written), and
* asks for the prompt log-probs of its continuation only: positions
  ``[len(context) - 1, len(context) + len(continuation) - 1)``.

A continuation's log-likelihood is the sum of those log-probs; it is greedy
when every continuation token is the most likely one at its position.
``max_length`` truncates ``context + continuation`` from the left to
``max_length + 1`` tokens first, as lm-eval's HF backend does.

``score_rolling(documents)`` cuts each document into lm-eval's disjoint
rolling windows (``rolling_windows``) and sums their scores.

Blocks come from a ``BlockPool`` (the caller's, or one over the runtime's
whole KV pool) and go back to it after each round, on failure too.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Sequence

import attrs
import torch

from prefill_core import ExecutionMode, PageTableLayout, SamplingParams, ceil_div, execution_mode
from prefill_core.values.errors import CapacityError, InvalidScoringRequestError, PrefillConfigError, row_error
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.scoring.prefix_sharing import share_prefix, sharing_groups

__all__ = [
    "BlockPool",
    "ContinuationScore",
    "Scorer",
    "encode_pair",
    "prefix_token_id",
    "rolling_windows",
    "scoring_layout",
    "window_length",
]


@attrs.frozen
class ContinuationScore:
    """One continuation's log-likelihood, whether it is the greedy continuation, and its length in tokens."""

    logprob: float
    is_greedy: bool
    num_tokens: int


class BlockPool:
    """KV block ids a scorer may use: taken for a round, given back after it."""

    def __init__(self, block_ids: Sequence[int]):
        self._free = list(block_ids)
        for index, block in enumerate(self._free):
            if not _is_int(block) or block < 0:
                raise PrefillConfigError(f"BlockPool block_ids[{index}]={block!r} is invalid: must be an int >= 0")
        self._free = [int(block) for block in self._free]
        self.size = len(self._free)

    @property
    def available(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CapacityError(f"the block pool has {len(self._free)} free blocks; {count} are needed")
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def give_back(self, block_ids: Sequence[int]) -> None:
        self._free.extend(block_ids)


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows (``context_len=1``): ``(context, continuation)`` pairs.

    Every token is predicted exactly once; the first window conditions on
    ``prefix_token``, each later one on the tokens just before it, so that
    ``context + continuation`` is at most ``max_length + 1`` tokens.
    """
    _check_max_length(max_length)
    tokens = list(tokens)
    windows, done = [], 0
    while done < len(tokens):
        size = min(max_length, len(tokens) - done)
        end = done + size
        context = [prefix_token] if done == 0 else tokens[max(end - max_length - 1, 0) : done]
        windows.append((context, tokens[done:end]))
        done = end
    return windows


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_max_length(max_length: object) -> None:
    """A window length: an int >= 1 (a window of 0 tokens would never advance over a document)."""
    if not _is_int(max_length) or max_length < 1:
        raise PrefillConfigError(f"max_length={max_length!r} is invalid: must be None or an int >= 1")


def window_length(given: int | None, max_position: int, name: str) -> int:
    """lm-eval's ``max_length`` for a model of ``max_position`` positions: ``given``, or the longest that fits.

    A scored row holds ``max_length + 1`` tokens, so more than
    ``max_position - 1`` is refused (``name`` is how the caller spelled it):
    it would size a pool for rows the core refuses.
    """
    most = max_position - 1
    if given is not None and given > most:
        rule = f"must be <= {most} (a scored row of max_length + 1 tokens fits the model)"
        raise PrefillConfigError(f"{name}={given} is invalid: {rule}")
    return most if given is None else given


def scoring_layout(max_length: int, block_size: int, num_blocks: int | None = None) -> PageTableLayout:
    """A layout for rows of ``max_length + 1`` tokens; its pool (by default) four such rows, and no fewer
    than 16384 tokens' blocks, so a round holds several rows and a shared context."""
    row_blocks = ceil_div(max_length + 1, block_size)
    return PageTableLayout(block_size, row_blocks, num_blocks or max(4 * row_blocks, ceil_div(16384, block_size)))


def _refused(index: int, field: str, shown: str, rule: str) -> InvalidScoringRequestError:
    return InvalidScoringRequestError(f"row {index}: {field}={shown} is invalid: {rule}", row=index, field=field)


def _token_ids(index: int, field: str, value: object, vocab_size: int) -> list[int]:
    """``value`` as a list of token ids in ``[0, vocab_size)``: a sequence of ints, a 1-D integer tensor or array.

    Anything else is a named error at the caller's ``index``: the runtime
    would name a row of the scorer's own call, which lays pairs out its way.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype is torch.bool:
            rule = "must be a sequence of token ids (ints) or a 1-D integer tensor"
            raise _refused(index, field, f"<tensor {value.dtype} {tuple(value.shape)}>", rule)
        value = value.tolist()
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 1:
        value = value.tolist()  # its items are judged below, as a list's
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        rule = "must be a sequence of token ids (ints); encode text first (score_text)"
        raise _refused(index, field, f"<{type(value).__name__}>", rule)
    for position, item in enumerate(value):
        if not _is_int(item):
            raise _refused(index, f"{field}[{position}]", repr(item), "token ids must be ints")
    ids = [int(item) for item in value]
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        position = next(p for p, token in enumerate(ids) if not 0 <= token < vocab_size)
        rule = f"token ids must lie in [0, vocab_size={vocab_size})"
        raise _refused(index, f"{field}[{position}]", repr(ids[position]), rule)
    return ids


def _pair(index: int, pair: object, vocab_size: int) -> tuple[list[int], list[int]]:
    """A ``(context, continuation)`` pair's token ids; anything else names its row."""
    if not isinstance(pair, Sequence) or isinstance(pair, (str, bytes)) or len(pair) != 2:
        rule = "must be a (context, continuation) pair of token-id sequences"
        raise _refused(index, "pair", f"<{type(pair).__name__}>", rule)
    return _token_ids(index, "context", pair[0], vocab_size), _token_ids(index, "continuation", pair[1], vocab_size)


def prefix_token_id(tokenizer) -> int:
    """The token an empty context is conditioned on: BOS, else EOS (lm-eval's ``prefix_token_id``)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of a text pair: trailing spaces of the context belong to the continuation; the
    continuation's ids are those of the whole text past the context's.

    An empty context (or one of spaces only) is conditioned on ``prefix_token_id`` as lm-eval's
    ``TemplateLM.loglikelihood`` does (EleutherAI/lm-evaluation-harness ``lm_eval/api/model.py``, as
    installed in the 3.12 venv): the continuation encoded without special tokens, and when it already
    begins with that token, its first token is the context.
    """
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if context == "":
        prefix, ids = prefix_token_id(tokenizer), tokenizer.encode(continuation, add_special_tokens=False)
        return (ids[:1], ids[1:]) if ids[:1] == [prefix] else ([prefix], ids)
    context_ids = tokenizer.encode(context)
    return context_ids, tokenizer.encode(context + continuation)[len(context_ids) :]


@attrs.frozen
class _Row:
    """One follow-up row: its pair, tokens, context length, shared length and shared block ids."""

    pair: int
    tokens: tuple[int, ...]
    context_length: int
    cached: int
    shared_blocks: tuple[int, ...]


class Scorer:
    """Scores continuations and documents on one ``PrefillRuntime``.

    ``pool``: the KV blocks it may use (default: every block of the
    runtime's layout). ``max_rows``: follow-up rows per round (one prefill
    call). ``mode`` (``prefill_core.ExecutionMode``, as the runtime takes
    it): ``"traced"`` runs every request by trace replay, capturing traces
    and workspaces on first use; ``"auto"`` replays where traces exist;
    ``"eager"`` never does. ``positions_computed`` counts
    the positions the model body ran, over every call.
    """

    def __init__(
        self,
        runtime: PrefillRuntime,
        pool: BlockPool | None = None,
        *,
        max_length: int | None = None,
        max_rows: int = 32,
        mode: ExecutionMode | str = ExecutionMode.AUTO,
    ):
        if max_length is not None:
            _check_max_length(max_length)
        if not _is_int(max_rows) or max_rows < 1:
            raise PrefillConfigError(f"Scorer max_rows={max_rows!r} is invalid: must be an int >= 1")
        layout = runtime.config.layout
        spec = runtime.config.model.spec
        self.runtime = runtime
        self.vocab_size = spec.vocab_size
        self.max_row_tokens = min(layout.capacity, spec.max_position)  # the core's capacity and position rules
        self.pool = BlockPool(range(layout.num_blocks)) if pool is None else pool
        self.block_size = layout.block_size
        self.max_length = max_length
        self.max_rows = max_rows
        self.mode = execution_mode(mode)
        self.positions_computed = 0

    # -- public API ---------------------------------------------------------
    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[ContinuationScore]:
        """Each ``(context, continuation)`` pair's score, in the caller's order."""
        if not isinstance(pairs, Sequence) or isinstance(pairs, (str, bytes)):
            msg = f"pairs=<{type(pairs).__name__}> is invalid: must be a sequence of (context, continuation) pairs"
            raise InvalidScoringRequestError(msg, field="pairs")
        rows = self._rows(pairs)
        scores: dict[int, ContinuationScore] = {}
        for group_rows in self._rounds(rows):
            for row, score in zip(group_rows, self._run_round(group_rows)):
                scores[row.pair] = score
        return [scores[pair] for pair in range(len(rows))]

    def score_rolling(self, documents: Sequence[Sequence[int]], prefix_token: int) -> list[float]:
        """Each document's log-likelihood over lm-eval's disjoint rolling windows of ``max_length``."""
        if self.max_length is None:
            raise InvalidScoringRequestError("score_rolling needs the Scorer's max_length (the window length)")
        if not _is_int(prefix_token) or not 0 <= prefix_token < self.vocab_size:
            msg = f"prefix_token={prefix_token!r} is invalid: must be a token id (an int in [0, {self.vocab_size}))"
            raise InvalidScoringRequestError(msg, field="prefix_token")
        if not isinstance(documents, Iterable) or isinstance(documents, (str, bytes)):
            msg = f"documents=<{type(documents).__name__}> is invalid: must be a sequence of token-id sequences"
            raise InvalidScoringRequestError(msg, field="documents")
        documents = [_token_ids(index, "document", doc, self.vocab_size) for index, doc in enumerate(documents)]
        windows = [rolling_windows(doc, int(prefix_token), self.max_length) for doc in documents]
        flat = self.score([w for doc in windows for w in doc])
        totals, at = [], 0
        for doc in windows:
            totals.append(sum(s.logprob for s in flat[at : at + len(doc)]))
            at += len(doc)
        return totals

    def score_text(self, tokenizer, pairs: Sequence[tuple[str, str]]) -> list[ContinuationScore]:
        """``score`` on text pairs, encoded by ``encode_pair``."""
        return self.score([encode_pair(tokenizer, c, x) for c, x in pairs])

    # -- rows, groups, rounds -----------------------------------------------
    def _rows(self, pairs) -> list[_Row]:
        """Truncated token rows, laid out by group: shared lengths come from ``prefix_sharing``."""
        rows: dict[int, _Row] = {}
        full, context_lengths = [], []
        for i, pair in enumerate(pairs):
            tokens, length = self._truncated(i, *_pair(i, pair, self.vocab_size))
            full.append(tokens)
            context_lengths.append(length)
        # What a row may share is its context without the last token: the row
        # recomputes the position that predicts its first continuation token.
        shareable = [tokens[: length - 1] for tokens, length in zip(full, context_lengths)]
        groups = sharing_groups(shareable, self.block_size)
        grouped = {i for group in groups for i in group}
        for group in groups + [[i] for i in range(len(pairs)) if i not in grouped]:
            layout = share_prefix([shareable[i] for i in group], self.block_size)
            blocks = tuple(layout.prefix_blocks)
            for i, cached in zip(group, layout.cached):
                rows[i] = _Row(i, tuple(full[i]), context_lengths[i], cached, blocks if cached else ())
        return [rows[i] for i in range(len(pairs))]

    def _truncated(self, index: int, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        if not continuation:
            raise row_error(InvalidScoringRequestError, index, "continuation", continuation, "must hold >= 1 token")
        if not context:
            raise row_error(
                InvalidScoringRequestError, index, "context", context, "must hold >= 1 token (use a prefix token)"
            )
        tokens = context + continuation
        if self.max_length is not None:
            if len(continuation) > self.max_length:
                rule = f"must hold at most max_length={self.max_length} tokens"
                raise row_error(InvalidScoringRequestError, index, "continuation", len(continuation), rule)
            tokens = tokens[-(self.max_length + 1) :]
        if len(tokens) > self.max_row_tokens:
            rule = f"must fit in one row of at most {self.max_row_tokens} tokens (set max_length to truncate)"
            msg = f"row {index}: pair=<{len(tokens)} tokens> is invalid: {rule}"
            raise CapacityError(msg, row=index, field="pair")
        return tokens, len(tokens) - len(continuation)

    def _rounds(self, rows: list[_Row]) -> Iterator[list[_Row]]:
        """Rows in rounds of at most ``max_rows`` follow-up rows and the pool's free blocks.

        A sharing group larger than a round is split over several: each round
        that holds some of its rows maps (and prefills) its shared blocks once,
        so any set of pairs whose rows fit the pool one at a time runs. Every
        row is checked against the pool before the first round runs.
        """
        by_group: dict[tuple, list[_Row]] = {}
        for row in rows:
            need = len(row.shared_blocks) + self._own_blocks(row)
            if need > self.pool.available:
                msg = f"row {row.pair}: it needs {need} KV blocks; the pool has {self.pool.available} free"
                raise CapacityError(msg, row=row.pair, field="pair")
            by_group.setdefault(row.tokens[: row.cached] if row.cached else ("single", row.pair), []).append(row)
        batch: list[_Row] = []
        blocks = 0
        for members in by_group.values():
            shared = len(members[0].shared_blocks)
            in_batch = False  # whether this round already maps the group's shared blocks
            for row in members:
                need = self._own_blocks(row) + (0 if in_batch else shared)
                if batch and (len(batch) == self.max_rows or blocks + need > self.pool.available):
                    yield batch
                    batch, blocks = [], 0
                    need = self._own_blocks(row) + shared
                batch.append(row)
                blocks += need
                in_batch = True
        if batch:
            yield batch

    def _own_blocks(self, row: _Row) -> int:
        return ceil_div(len(row.tokens), self.block_size) - row.cached // self.block_size

    # -- one round ------------------------------------------------------------
    def _run_round(self, rows: list[_Row]) -> list[ContinuationScore]:
        taken: list[int] = []
        try:
            shared: dict[tuple[int, ...], list[int]] = {}
            for row in rows:  # local prefix block ids -> pool blocks, once per group
                if row.shared_blocks and row.tokens[: row.cached] not in shared:
                    shared[row.tokens[: row.cached]] = self._take(len(row.shared_blocks), taken)
            own = [self._take(self._own_blocks(r), taken) for r in rows]
            return self._prefill_round(rows, shared, own)
        finally:
            self.pool.give_back(taken)

    def _take(self, count: int, taken: list[int]) -> list[int]:
        blocks = self.pool.take(count)
        taken.extend(blocks)
        return blocks

    def _prefill_round(self, rows: list[_Row], shared, own) -> list[ContinuationScore]:
        """One call: each group's shared whole blocks (once), then the follow-ups that read them as cached.

        The contexts' rows write the shared blocks whole at the columns the
        follow-ups read them, so the planner runs them first (a same-step
        prefix hit, ``prefill_core.planning.block_order``): packed, in the same steps
        where they fit. Their last-token output is not needed.
        """
        contexts = list(shared)
        tables = [shared[p] for p in contexts] + [
            shared.get(r.tokens[: r.cached], []) + blocks for r, blocks in zip(rows, own)
        ]
        context_sampling = [SamplingParams.greedy()] * len(contexts)
        results = self._prefill(
            _matrix(contexts + [r.tokens for r in rows]),
            _matrix(tables, filler=-1).to(torch.int32),
            [len(p) for p in contexts] + [len(r.tokens) for r in rows],
            [0] * len(contexts) + [r.cached for r in rows],
            context_sampling
            + [SamplingParams.greedy(prompt_logprobs=1, prompt_start=r.context_length - 1) for r in rows],
        )
        return [_continuation_score(result.prompt_logprobs) for result in results[len(contexts) :]]

    def _prefill(self, tokens, table, lengths, cached, sampling):
        runtime = self.runtime
        # One call to every other thread: a release_traces() or close() between the capture and the replay
        # would otherwise surface here as a missing trace instead of being refused by name over there.
        with runtime.hold():
            batch = runtime.prepare(tokens, table, lengths, cached, sampling=sampling, mode=self.mode)
            for prepared in batch.requests:
                self.positions_computed += prepared.request.computed_tokens
                if self.mode is ExecutionMode.TRACED and runtime.trace_gap(prepared) is not None:
                    runtime.capture(prepared.trace_signature)
                    runtime.allocate_workspace(prepared.program_signature)
            return runtime.assemble(runtime.invocations(batch), batch.num_rows)


def _matrix(rows: Sequence[Sequence[int]], filler: int = 0) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), filler, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(list(row), dtype=torch.int64)
    return out


def _continuation_score(entries) -> ContinuationScore:
    logprob = sum(e.logprob for e in entries)
    greedy = all(e.top and e.top[0][0] == e.token for e in entries)
    return ContinuationScore(logprob, greedy, len(entries))
