"""``--profile`` of ``prefill_throughput.py``: one run of ours split into matmuls, attention, norms/rotary,
LM head and host work.

Op self times come from ``torch.profiler`` (with input shapes, so the LM
head's matmul, the one whose weight has the vocabulary's rows, is told apart
from the body's weight matmuls). Host work is the call's wall time minus
every op's self time: planning, staging, Python between ops.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["profile_call"]

MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "mkldnn::_linear_pointwise")  # the last: oneDNN
ATTENTION = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
    "aten::index",  # paged K/V gathers
    "aten::index_put_",  # packed K/V writes
    "aten::index_copy_",  # padded K/V writes
    "aten::tril",  # chunk masks (padded path)
    "aten::triu_",  # segment masks (packed path)
    "prefill::flash_attention",  # the CPU kernel of packed steps (prefill_shell/reference/cpu_kernels)
)
NORMS_ROTARY = (
    "aten::rms_norm",
    "aten::_fused_rms_norm",
    "aten::mul",
    "aten::mul_",
    "aten::add",
    "aten::cat",
    "aten::addcmul",
    "aten::neg",
    "aten::rsqrt",
    "aten::mean",
    "aten::pow",
    "aten::silu",
    "aten::silu_",
    "aten::embedding",
    "prefill::rms_norm",  # the CPU kernels (prefill_shell/reference/cpu_kernels)
    "prefill::rope_write",
)


def profile_call(call: Callable[[], object], vocab_size: int) -> dict[str, float]:
    """Seconds per group of one profiled ``call()`` (after a warm run)."""
    from torch.profiler import profile

    call()
    with profile(record_shapes=True) as prof:
        start = time.perf_counter()
        call()
        wall = time.perf_counter() - start
    groups = {"matmuls": 0.0, "attention": 0.0, "norms/rotary": 0.0, "LM head": 0.0, "other ops": 0.0}
    ops_total = 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        seconds = event.self_cpu_time_total / 1e6
        ops_total += seconds
        if event.key in MATMULS:
            head = any(vocab_size in shape for shape in event.input_shapes if shape)
            groups["LM head" if head else "matmuls"] += seconds
        elif event.key in ATTENTION:
            groups["attention"] += seconds
        elif event.key in NORMS_ROTARY:
            groups["norms/rotary"] += seconds
        else:
            groups["other ops"] += seconds
    groups["host work"] = max(wall - ops_total, 0.0)
    groups["wall"] = wall
    return groups
