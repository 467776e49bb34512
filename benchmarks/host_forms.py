"""Forms the code chose for speed, each measured beside the plain form it replaced.

    python benchmarks/host_forms.py [--quick] [--threads N]

Two torch threads by default, as ``prefill_throughput.py`` runs the model.

Each row times the chosen form and the plain alternative, interleaved in one
run (the machine is shared and drifts), and reports both medians and the
ratio plain/chosen. A ratio near 1 means the choice no longer pays and the
plain form should come back.

* ``inference_mode``: entering ``torch.inference_mode`` once per invocation
  (``PrefillRuntime.invoke``) vs once per model call (body and LM head).
* ``lm_head_{1,8,32,1024}rows``: the reference model's LM head at the bench
  model's 32000 x 512 head, a ``Projection`` (weight prepacked for oneDNN
  on the CPU up to its probed row limit, ``packed_row_limit``, the plain weight past it;
  ``prefill_shell/reference/llama_like/projection.py``) vs the other form: ``F.linear``
  at or under the limit (key ``plain``), the prepacked weight past it (key
  ``packed``).
* ``qkv_{128,1024}rows`` / ``swiglu_mlp_{128,512,1024,4096}rows``: the same
  choice in the model body at SmolLM2-135M's shapes (576 wide, fused QKV 960
  rows, MLP 1536): the QKV projection, and the whole SwiGLU MLP with its
  residual add (prepacked, activation and add fused into the GEMM calls, vs
  ``F.linear``, ``F.silu``, ``mul`` and ``addmm``); the MLP also in bfloat16
  (``swiglu_mlp_{128,512,4096}rows_bfloat16``) where the CPU computes it
  natively.
* ``up_times_{32,512,4096}rows_<dtype>``: SwiGLU's product on the
  prepacked up weight at SmolLM2's shapes, ``Projection.times`` (the
  multiply fused as oneDNN's post-op up to 256 rows, oneDNN's plain GEMM
  then ``mul_`` past them) vs the other of the two (key ``other``), where
  the dtype is prepacked.
* ``shared_prefix_*`` and ``cached_attention_*`` below time torch's SDPA
  path, which a packed step takes where ``reference/cpu_kernels`` does not
  apply (no AVX-512, CUDA, ``PREFILL_CPU_KERNELS=torch``).
* ``shared_prefix_{chat16,documents16}_<dtype>``: one layer's attention
  of 16 cached segments behind one shared prefix at SmolLM2's heads, as
  ``segment_reads`` runs it (short chat turns of 18-30 tokens behind 160:
  one padded call; documents of 32-256 tokens behind 256: one call each) vs
  the other way (key ``per_segment`` or ``grouped``).
* ``packed_attention_{uncached32x128,mixed8,chat16,documents16}_<dtype>``:
  one layer's attention over a whole packed step as ``forward_packed`` runs
  it where the CPU runs ``reference/cpu_kernels``'s kernel (one call for
  every segment, prefixes read from the pool in place) vs torch's SDPA a
  segment at a time (``segment_attention``, key ``torch_sdpa``): 32 prompts
  of 128 and 8 of 64-1024 at the bench Llama's heads (8 query, 4 K/V, 64
  wide), the chat and document steps of ``shared_prefix_*`` at SmolLM2's.
* ``kernel_threads_{norm<N>,rope<N>,attention_<case>}_<dtype>``: a
  ``reference/cpu_kernels`` call on the threads ``library.threads_for``
  picks (torch's OpenMP threads from two work items and a floor of work
  on, else the calling thread alone) vs the other of the two (key
  ``other``): RMSNorm of ``N`` rows 576
  wide, rotary and pool writes of ``N`` tokens at SmolLM2's heads, one
  layer's attention of one prompt of 32 or 128 tokens (bench Llama heads)
  and of 4 chat turns of 8 tokens behind 181 (SmolLM2's). Each call reads
  the output of a GEMM run just before it, as in a step; only the kernel's
  call is timed.
* ``cached_attention_p<P>_s<S>_<dtype>``: one cached segment's attention at
  SmolLM2's heads (9 query, 3 K/V, 64 wide) over a prefix of ``P`` and its
  own ``S`` tokens, as ``segment_attention`` runs it on the CPU (one masked
  call up to ``ONE_CALL_KEYS`` keys, ``prefix_then_causal`` past it) vs the
  other form; keys ``other_us`` and ``other_over_chosen``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Metric, report
from prefill_shell.backends.host_memory import keep_freed_host_memory
from prefill_shell.reference.cpu_kernels import library
from prefill_shell.reference.cpu_kernels import rms_norm as norm_module
from prefill_shell.reference.cpu_kernels.flash import flash_step
from prefill_shell.reference.cpu_kernels.library import kernel_dtypes
from prefill_shell.reference.cpu_kernels.rope import rope_step
from prefill_shell.reference.llama_like import packed_attention
from prefill_shell.reference.llama_like.packed_attention import (
    ONE_CALL_KEYS,
    prefix_then_causal,
    segment_attention,
    segment_reads,
)
from prefill_shell.reference.llama_like.projection import PACKED_MAX_ROWS, Projection, prepacks
from prefill_shell.reference.pools.kv_cache import PagedKVCache

keep_freed_host_memory()  # as TorchBackend does on the CPU: freed activations' pages serve the next call


def _mode_per_call() -> None:
    for _ in range(2):  # the body and the LM head
        with torch.inference_mode():
            pass


def _mode_per_invocation() -> None:
    with torch.inference_mode():
        pass


_GEN = torch.Generator().manual_seed(0)
HIDDEN, QKV, INTERMEDIATE = 576, 960, 1536  # SmolLM2-135M


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_GEN)


def _forced(fn, projections, max_rows: int):
    """``fn`` with ``projections`` taking the prepacked weight for products of up to ``max_rows`` rows."""

    def call():
        saved = [p.max_rows for p in projections]
        for p in projections:
            p.max_rows = max_rows
        try:
            return fn()
        finally:
            for p, limit in zip(projections, saved):
                p.max_rows = limit

    return call


def _against_other_form(rows: int, chosen, plain, *projections) -> tuple:
    """``(chosen, other, other's key)``: where the chosen form runs prepacked (``rows`` within the probed
    limit) the other is the plain expression; past the limit the other is every product prepacked."""
    if rows <= min(p.max_rows for p in projections):
        return chosen, plain, "plain"
    return chosen, _forced(chosen, projections, sys.maxsize), "packed"


def _head_case(rows: int) -> tuple:
    head, x = _randn(32000, 512), _randn(rows, 512)
    form = Projection(head)
    return _against_other_form(rows, lambda: form(x), lambda: F.linear(x, head), form)


def _qkv_case(rows: int) -> tuple:
    weight, x = _randn(QKV, HIDDEN), _randn(rows, HIDDEN)
    form = Projection(weight)
    return _against_other_form(rows, lambda: form(x), lambda: F.linear(x, weight), form)


def _mlp_case(rows: int, dtype: torch.dtype = torch.float32) -> tuple:
    gate, up = _randn(INTERMEDIATE, HIDDEN).to(dtype), _randn(INTERMEDIATE, HIDDEN).to(dtype)
    down = (_randn(HIDDEN, INTERMEDIATE) / INTERMEDIATE**0.5).to(dtype)
    x, residual = _randn(rows, HIDDEN).to(dtype), _randn(rows, HIDDEN).to(dtype)
    g, u, d = Projection(gate), Projection(up), Projection(down)

    def chosen():
        return d.plus(u.times(x, g.silu(x)), residual)

    def plain():
        return torch.addmm(residual, F.silu(F.linear(x, gate)).mul_(F.linear(x, up)), down.t())

    return _against_other_form(rows, chosen, plain, g, u, d)


def _up_times_case(rows: int, dtype: torch.dtype) -> tuple:
    """SwiGLU's product on the prepacked up weight: ``Projection.times`` (oneDNN's multiply post-op up to
    ``PACKED_MAX_ROWS`` rows, its plain GEMM then ``mul_`` past them) vs the other of the two (key ``other``)."""
    up = (_randn(INTERMEDIATE, HIDDEN) / HIDDEN**0.5).to(dtype)
    x, gate = _randn(rows, HIDDEN).to(dtype), _randn(rows, INTERMEDIATE).to(dtype)
    form = Projection(up)
    form.max_rows = sys.maxsize
    packed = torch.ops.mkldnn._reorder_linear_weight(up, 1024)
    linear = torch.ops.mkldnn._linear_pointwise

    def fused():
        return linear.binary(x, gate, packed, None, "mul")

    def then_mul():
        return linear(x, packed, None, "none", [], "").mul_(gate)

    return lambda: form.times(x, gate), fused if rows > PACKED_MAX_ROWS else then_mul, "other"


def _cached_attention_case(prefix: int, own: int, dtype: torch.dtype) -> tuple:
    heads, kv_heads, dim = 9, 3, 64
    q = _randn(1, heads, own, dim).to(dtype)
    old = tuple(_randn(1, kv_heads, prefix, dim).to(dtype) for _ in range(2))
    new = tuple(_randn(1, kv_heads, own, dim).to(dtype) for _ in range(2))
    mask = torch.full((own, prefix + own), float("-inf"), dtype=dtype).triu_(diagonal=prefix + 1)

    def one_call():
        keys, values = (torch.cat((a, b), dim=2) for a, b in zip(old, new))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def two_calls():
        return prefix_then_causal(q, old, new)

    return (one_call, two_calls) if prefix + own <= ONE_CALL_KEYS else (two_calls, one_call)


def _segments_behind(prefix: int, lengths: list[int], kv_heads: int, dtype: torch.dtype) -> tuple:
    """``(kv, segments, table, total)``: segments of ``lengths`` end to end, each behind the same ``prefix`` of
    random K/V in one layer's pool (64 wide, blocks of 16)."""
    width = max(-(-prefix // 16), 1)
    kv = PagedKVCache(1, width, 16, kv_heads, 64, dtype=dtype)
    kv.keys[0].copy_(_randn(*kv.keys[0].shape).to(dtype))
    kv.values[0].copy_(_randn(*kv.values[0].shape).to(dtype))
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    segments = torch.tensor([[o, n, prefix] for o, n in zip(offsets, lengths)])
    table = torch.arange(width, dtype=torch.int32).expand(len(lengths), -1)
    return kv, segments, table, sum(lengths)


def _shared_prefix_case(prefix: int, lengths: list[int], dtype: torch.dtype) -> tuple:
    """Cached segments behind one shared prefix, one layer's attention at SmolLM2's heads: as
    ``segment_reads`` groups them (``SHARED_PREFIX_LENGTH``) vs the other way (grouped where it does not
    group, per segment where it does)."""
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    kv, segments, table, total = _segments_behind(prefix, lengths, kv_heads, dtype)
    qkv = tuple(_randn(total, h, dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    chosen_reads = segment_reads(segments, table, bs, dtype)
    grouped = any(r.padded is not None for r in chosen_reads.segments)
    saved = packed_attention.SHARED_PREFIX_LENGTH
    packed_attention.SHARED_PREFIX_LENGTH = 0 if grouped else sys.maxsize
    try:
        other_reads = segment_reads(segments, table, bs, dtype)
    finally:
        packed_attention.SHARED_PREFIX_LENGTH = saved

    def sdpa(q, k, v, **kwargs):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)

    def attend(reads):
        return lambda: segment_attention(kv, 0, qkv, reads, sdpa)

    return attend(chosen_reads), attend(other_reads), "per_segment" if grouped else "grouped"


def _packed_attention_case(heads: int, kv_heads: int, prefix: int, lengths: list[int], dtype: torch.dtype) -> tuple:
    """One layer's attention over a packed step: the CPU kernel's one call vs torch's SDPA per segment."""
    dim, bs = 64, 16
    kv, segments, table, total = _segments_behind(prefix, lengths, kv_heads, dtype)
    qkv = tuple(_randn(total, h, dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    step = flash_step(segments, table, kv, heads, kv_heads, dim, dtype, total)
    reads = segment_reads(segments, table, bs, dtype)

    def sdpa(q, k, v, **kwargs):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)

    return (lambda: step(kv, 0, *qkv)), (lambda: segment_attention(kv, 0, qkv, reads, sdpa)), "torch_sdpa"


class _FromGemm:
    """A GEMM of ``tokens`` rows out of 576 into ``width`` (``prepare``, untimed), then ``call`` on its output
    (timed), as a step runs a kernel on what its last projection wrote, torch's threads still warm from it."""

    def __init__(self, tokens: int, width: int, dtype: torch.dtype, call):
        self.projection, self.x, self.call = (
            Projection(_randn(width, 576).to(dtype)),
            _randn(tokens, 576).to(dtype),
            call,
        )

    def prepare(self):
        return self.projection(self.x)


def _with_threads(module, threads: int, call):
    """``call`` with ``module.threads_for`` answering ``threads``."""
    module.threads_for = lambda *_: threads
    try:
        return call()
    finally:
        module.threads_for = library.threads_for


def _norm_threads_case(rows: int, dtype: torch.dtype) -> tuple:
    weight = _randn(576).to(dtype)

    def norm(x):
        return norm_module.rms_norm_rows(x, weight, 1e-6)

    other = 1 - library.threads_for(-(-rows // norm_module.NORM_ROWS), rows * 576 >= library.SHARED_ELEMENTS)
    chosen = _FromGemm(rows, 576, dtype, norm)
    return chosen, _FromGemm(rows, 576, dtype, lambda x: _with_threads(norm_module, other, lambda: norm(x))), "other"


def _rope_threads_case(tokens: int, dtype: torch.dtype) -> tuple:
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    kv = PagedKVCache(1, tokens // bs + 1, bs, kv_heads, dim, dtype=dtype)
    cos, sin = _randn(tokens, dim).to(dtype), _randn(tokens, dim).to(dtype)
    steps = [rope_step(cos, sin, torch.arange(tokens), kv, heads, kv_heads) for _ in range(2)]
    steps[1].threads = 1 - steps[0].threads  # the other choice: 0 is torch's threads, 1 the calling thread

    def rotate(step, qkv):
        qk = qkv[:, : (heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim))
        return step(kv, 0, qk, qkv[:, (heads + kv_heads) * dim :].unflatten(-1, (kv_heads, dim)))

    width = (heads + 2 * kv_heads) * dim
    return (*(_FromGemm(tokens, width, dtype, lambda x, s=s: rotate(s, x)) for s in steps), "other")


def _attention_threads_case(heads: int, kv_heads: int, prefix: int, lengths: list[int], dtype: torch.dtype):
    dim = 64
    kv, segments, table, total = _segments_behind(prefix, lengths, kv_heads, dtype)
    steps = [flash_step(segments, table, kv, heads, kv_heads, dim, dtype, total) for _ in range(2)]
    steps[1].threads = 1 - steps[0].threads

    def attend(step, qkv):
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return step(kv, 0, q.unflatten(-1, (heads, dim)), *(t.unflatten(-1, (kv_heads, dim)) for t in (k, v)))

    out = (heads + 2 * kv_heads) * dim
    return (*(_FromGemm(total, out, dtype, lambda x, s=s: attend(s, x)) for s in steps), "other")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CASES = {"inference_mode": (_mode_per_invocation, _mode_per_call)}
GEMM_CASES = {  # name: (chosen, other, the other form's key)
    **{f"lm_head_{n}rows": _head_case(n) for n in (1, 8, 32, 1024)},
    **{f"qkv_{n}rows": _qkv_case(n) for n in (128, 1024)},
    **{f"swiglu_mlp_{n}rows": _mlp_case(n) for n in (128, 512, 1024, 4096)},
    # where bfloat16 is prepacked at all (the CPU computes it natively)
    **(
        {f"swiglu_mlp_{n}rows_bfloat16": _mlp_case(n, torch.bfloat16) for n in (128, 512, 4096)}
        if prepacks(torch.empty(1, 1, dtype=torch.bfloat16))
        else {}
    ),
    **{
        f"up_times_{n}rows_{d}": _up_times_case(n, dtype)
        for d, dtype in DTYPES.items()
        for n in (32, 512, 4096)
        if prepacks(torch.empty(1, 1, dtype=dtype))
    },
}
OTHER_CASES = {  # name: (chosen, other, the other form's key)
    f"cached_attention_p{p}_s{n}_{d}": (*_cached_attention_case(p, n, dtype), "other")
    for d, dtype in DTYPES.items()
    for p, n in ((160, 6), (320, 48), (1024, 256))
}
_CHAT_TURNS = [18, 30, 22, 25, 19, 28, 24, 21, 27, 23, 26, 20, 29, 24, 22, 25]
_DOCUMENTS = [32 + (97 * i) % 225 for i in range(16)]
_MIXED8 = [64 + (389 * i) % 961 for i in range(8)]
OTHER_CASES.update(
    {
        f"packed_attention_{name}_{d}": _packed_attention_case(*shape, dtype)
        for d, dtype in DTYPES.items()
        if dtype in kernel_dtypes()
        for name, shape in (
            ("uncached32x128", (8, 4, 0, [128] * 32)),
            ("mixed8", (8, 4, 0, _MIXED8)),
            ("chat16", (9, 3, 160, _CHAT_TURNS)),
            ("documents16", (9, 3, 256, _DOCUMENTS)),
        )
    }
)
OTHER_CASES.update(
    {
        f"shared_prefix_{name}_{d}": _shared_prefix_case(prefix, lengths, dtype)
        for d, dtype in DTYPES.items()
        for name, prefix, lengths in (("chat16", 160, _CHAT_TURNS), ("documents16", 256, _DOCUMENTS))
    }
)


KERNEL_CASES = {  # name: (chosen, other, the other form's key), each a _FromGemm
    f"kernel_threads_{name}_{d}": case
    for d, dtype in DTYPES.items()
    if dtype in kernel_dtypes()
    for name, case in (
        *((f"norm{n}", _norm_threads_case(n, dtype)) for n in (64, 128, 512)),
        *((f"rope{n}", _rope_threads_case(n, dtype)) for n in (32, 128, 512)),
        ("attention_1x32", _attention_threads_case(8, 4, 0, [32], dtype)),
        ("attention_1x128", _attention_threads_case(8, 4, 0, [128], dtype)),
        ("attention_chat4x8", _attention_threads_case(9, 3, 181, [8] * 4, dtype)),
    )
}


def _mean_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _kernel_us(form: _FromGemm, calls: int) -> float:
    total = 0.0
    for _ in range(calls):
        x = form.prepare()
        start = time.perf_counter()
        form.call(x)
        total += time.perf_counter() - start
    return total / calls * 1e6


def _interleaved(pair: tuple, r: int, n: int, timer=_mean_us) -> tuple[float, float]:
    """``(first form us, second form us)``, alternating which runs first by round."""
    order = pair if r % 2 == 0 else pair[::-1]
    times = [timer(fn, n) for fn in order]
    return tuple(times) if r % 2 == 0 else tuple(times[::-1])


def run(rounds: int, calls: int) -> list[Metric]:
    samples = {name: ([], []) for name in (*CASES, *GEMM_CASES, *OTHER_CASES, *KERNEL_CASES)}
    for r in range(rounds):
        for name, (chosen, plain) in CASES.items():
            for bucket, us in zip(samples[name], _interleaved((chosen, plain), r, calls)):
                bucket.append(us)
        for name, (chosen, other, _) in GEMM_CASES.items():  # a GEMM takes milliseconds
            for bucket, us in zip(samples[name], _interleaved((chosen, other), r, max(1, calls // 200))):
                bucket.append(us)
        for name, (chosen, other, _) in OTHER_CASES.items():
            for bucket, us in zip(samples[name], _interleaved((chosen, other), r, max(1, calls // 100))):
                bucket.append(us)
        for name, (chosen, other, _) in KERNEL_CASES.items():  # the kernel alone, after its GEMM
            for bucket, us in zip(samples[name], _interleaved((chosen, other), r, max(1, calls // 2), _kernel_us)):
                bucket.append(us)
    metrics = []
    for name, (chosen, other) in samples.items():
        c, o = statistics.median(chosen), statistics.median(other)
        label = {**GEMM_CASES, **OTHER_CASES, **KERNEL_CASES}[name][2] if name not in CASES else "plain"
        metrics += [
            Metric(f"{name}.chosen_us", c, "us"),
            Metric(f"{name}.{label}_us", o, "us"),
            Metric(f"{name}.{label}_over_chosen", o / c, "x", note=f"{rounds} interleaved rounds"),
        ]
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    report("host_forms", run(rounds=5 if ns.quick else 21, calls=200 if ns.quick else 2000))


if __name__ == "__main__":
    main()
