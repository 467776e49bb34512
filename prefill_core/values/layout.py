"""The paged-KV page-table layout a runtime is bound to."""

from __future__ import annotations

import attrs

from prefill_core.values.errors import InvalidLayoutError, field_error
from prefill_core.values.intmath import ceil_div

__all__ = ["PageTableLayout"]


def _positive(instance, attribute, value):
    if type(value) is not int or value <= 0:
        raise field_error(InvalidLayoutError, "PageTableLayout", attribute.name, value, "must be a positive int")


def _power_of_two(instance, attribute, value):
    _positive(instance, attribute, value)
    if value & (value - 1):
        # Padded lengths are powers of two above the ladder; a power-of-two
        # block size keeps every one of them block aligned.
        raise field_error(InvalidLayoutError, "PageTableLayout", attribute.name, value, "must be a power of two")


@attrs.frozen(cache_hash=True)  # a key of the per-configuration caches (validate._limits)
class PageTableLayout:
    """Shape of the caller's paged KV cache.

    ``block_size`` tokens per KV block; ``max_num_blocks_per_seq`` is the
    page-table width ceiling (so a prompt holds at most
    ``capacity = block_size * max_num_blocks_per_seq`` tokens);
    ``num_blocks`` is the size of the KV pool, so valid block ids are
    ``0 <= id < num_blocks``.
    """

    block_size: int = attrs.field(validator=_power_of_two)
    max_num_blocks_per_seq: int = attrs.field(validator=_positive)
    num_blocks: int = attrs.field(validator=_positive)

    @property
    def capacity(self) -> int:
        """Longest prompt, in tokens, a page-table row can map."""
        return self.block_size * self.max_num_blocks_per_seq

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return ceil_div(num_tokens, self.block_size)
