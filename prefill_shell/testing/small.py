"""The small geometry the shipped test tools run at.

Block size 16 and a 64-token max chunk make waves, chunked rows, cached
prefixes and every table role appear at lengths a tiny model prefills in
milliseconds; a 4-slot lane makes a call of five or more rows split into
sub-batches of at most 4 rows.
"""

from prefill_core import PrefillPolicy

__all__ = ["SMALL_BLOCK", "SMALL_POLICY"]

SMALL_BLOCK = 16
SMALL_POLICY = PrefillPolicy(
    length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4), max_logprobs=3, lane_size=4
)
