"""When the model raises midway, the error names the KV blocks that may now hold partial writes.

``error.partial_writes`` maps each caller row of the failed request to the
sorted blocks its started steps write (earlier chunks and the failing one);
rows of requests that completed earlier in the call are absent: their KV is
whole. The same facts ride along as a note.
"""

from __future__ import annotations

import pytest

from tests.helpers import CHUNK_256_POLICY, assign_blocks, build_runtime, make_tokens, page_table, token_matrix

BS, NUM_BLOCKS = 16, 64


class _Boom(RuntimeError):
    pass


class _FailsAtBody:
    """Delegates to a model and raises on hidden-body call ``fail_at`` (1-based)."""

    def __init__(self, inner, fail_at: int):
        self.inner, self.spec, self.dtype = inner, inner.spec, inner.dtype
        self.fail_at, self.calls = fail_at, 0

    def forward_hidden(self, *args):
        self.calls += 1
        if self.calls == self.fail_at:
            raise _Boom(f"injected failure in body call {self.calls}")
        return self.inner.forward_hidden(*args)

    def lm_head(self, rows):
        return self.inner.lm_head(rows)

    def new_kv_cache(self, num_blocks, block_size):
        return self.inner.new_kv_cache(num_blocks, block_size)


def _fail(tiny_model, fail_at, lengths, cached):
    model = _FailsAtBody(tiny_model, fail_at)
    rt = build_runtime(model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    blocks = assign_blocks(lengths, BS, NUM_BLOCKS, seed=21)
    rows = [make_tokens(n, seed=2100 + i) for i, n in enumerate(lengths)]
    with pytest.raises(_Boom) as info:
        rt.prefill(token_matrix(rows), page_table(blocks), lengths, cached)
    assert rt.backend.ledger.live() == []
    return info.value, blocks


def test_a_failing_chunk_names_the_blocks_of_its_started_chunks(tiny_model):
    """A 600-token row failing in its second 256-token chunk names the blocks of chunks one and two, not three."""
    error, blocks = _fail(tiny_model, fail_at=2, lengths=[600], cached=[0])
    assert error.partial_writes == {0: tuple(sorted(blocks[0][:32]))}
    assert any("partial writes" in note and "row 0" in note for note in error.__notes__)


def test_completed_requests_of_the_call_are_not_named(tiny_model):
    """A 300-token chunked row runs after a 40-token single request; failing it names only its own blocks."""
    error, blocks = _fail(tiny_model, fail_at=2, lengths=[40, 300], cached=[0, 0])
    assert error.partial_writes == {1: tuple(sorted(blocks[1][:16]))}


def test_cached_prefix_blocks_are_not_named(tiny_model):
    """A row cached to 64 tokens failing in its first step names only blocks from column 4 on (not its prefix)."""
    error, blocks = _fail(tiny_model, fail_at=1, lengths=[200], cached=[64])
    assert error.partial_writes == {0: tuple(sorted(blocks[0][4:13]))}


def test_a_failure_before_any_step_carries_no_partial_writes(tiny_model):
    """An input error raised while preparing writes nothing, and carries no partial_writes attribute."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    with pytest.raises(ValueError) as info:
        rt.prefill(make_tokens(40, seed=1)[None], page_table([[1, 2, 3]]), [40], [41])  # cached past the prompt
    assert not hasattr(info.value, "partial_writes")
