"""Features meeting in one call, against transformers on the same weights: packed, padded or traced steps, a
cached prefix written by an earlier call, prompt log-probs, one lane or two, block sizes 1-128, float32 and
bfloat16.

One hypothesis property draws the combination; the ci profile runs a sixth of its usual example count, the
fuzz profile 50 times that (``HYPOTHESIS_PROFILE=fuzz``).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams, WarmupManifest
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.lanes.group import LaneGroup
from prefill_shell.reference import random_llama, save_hf_folder
from tests.helpers import build_runtime, make_tokens, token_matrix

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLES = max(1, settings().max_examples // 6)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25}
"""Logit and log-prob agreement: float32 as the other oracle tests; bfloat16 kernels round differently."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per dtype: the seeded tiny model and transformers' Llama loaded from its own saved weights in that dtype."""
    out = {}
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = random_llama(0, "tiny", dtype=name, max_position_embeddings=1024)
        folder = save_hf_folder(model, tmp_path_factory.mktemp(f"tiny_{name}"))
        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        out[dtype] = (model, hf)
    return out


def _log_softmax(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor(tokens)[None]).logits[0].float(), dim=-1)


@st.composite
def combinations(draw):
    block = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]))
    prefix = draw(st.integers(0, 48)) if block <= 16 else draw(st.sampled_from([0, block]))
    own = draw(st.lists(st.integers(1, 24), min_size=1, max_size=3))
    return dict(
        block=block,
        prefix=prefix // block * block,  # the cached part: whole blocks a first call wrote
        own=own,
        mode=(mode := draw(st.sampled_from(["packed", "padded", "traced"]))),
        lanes=1 if mode == "traced" else draw(st.sampled_from([1, 2])),  # lanes plan per lane: warmed per call
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        prompt_logprobs=draw(st.lists(st.booleans(), min_size=len(own), max_size=len(own))),
        seed=draw(st.integers(0, 10_000)),
    )


def _table(tables: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(tables), max(len(t) for t in tables)), -1, dtype=torch.int32)
    for i, blocks in enumerate(tables):
        out[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return out


def _runtime(model, block: int, mode: str, num_blocks: int):
    policy = attrs.evolve(
        PrefillPolicy.fine_rungs(block, max_chunk_length=4 * block * 16), packed_steps=mode == "packed"
    )
    layout = PageTableLayout(block, num_blocks, num_blocks)
    return build_runtime(model, policy=policy, layout=layout)


@settings(max_examples=EXAMPLES)
@given(combinations())
def test_features_meet_as_transformers_computes(models, case):
    """Every row's last-token logits and asked prompt log-probs equal transformers' on its whole prompt."""
    model, hf = models[case["dtype"]]
    event(f"{case['mode']}, {case['lanes']} lane(s), cached {bool(case['prefix'])}, {case['dtype']}")
    block, prefix_len = case["block"], case["prefix"]
    prefix = make_tokens(prefix_len, case["seed"]).tolist()
    rows = [prefix + make_tokens(n, case["seed"] + 1 + i).tolist() for i, n in enumerate(case["own"])]
    prefix_blocks = list(range(prefix_len // block))
    tables, next_block = [], len(prefix_blocks)
    for row in rows:
        own = -(-len(row) // block) - len(prefix_blocks)
        tables.append(prefix_blocks + list(range(next_block, next_block + own)))
        next_block += own
    lanes = [PrefillExecutor(_runtime(model, block, case["mode"], max(next_block, 1))) for _ in range(case["lanes"])]
    executor, runtime = lanes[0], lanes[0].runtime
    for lane in lanes:  # each lane's pool holds the cached prefix its rows read
        if prefix_len:
            lane.prefill(torch.tensor([prefix]), torch.tensor([prefix_blocks], dtype=torch.int32), [prefix_len])
    call = dict(
        tokens=token_matrix([torch.tensor(r) for r in rows]),
        page_table=_table(tables),
        prompt_lengths=[len(r) for r in rows],
        cached_lengths=[prefix_len] * len(rows),
        sampling=[SamplingParams.greedy(3, prompt_logprobs=0 if asked else None) for asked in case["prompt_logprobs"]],
    )
    mode = "eager"
    if case["mode"] == "traced":
        executor.warm_up(WarmupManifest().observe(runtime.prepare(**call, mode="traced").requests))
        mode = "traced"
    if len(lanes) > 1:  # row i on lane i % 2: its slot is lane * lane_size + i // 2
        size = runtime.config.policy.lane_size
        call["slots"] = [i % 2 * size + i // 2 for i in range(len(rows))]
        results = LaneGroup(lanes).prefill(**call, mode=mode)
    else:
        results = executor.prefill(**call, mode=mode)
    tolerance = TOLERANCE[case["dtype"]]
    for row, result, asked in zip(rows, results, case["prompt_logprobs"]):
        logp = _log_softmax(hf, row)
        want = logp[-1].topk(3).values
        got = torch.tensor([value for _, value in result.top_logprobs])
        assert (got - want).abs().max().item() <= tolerance, case
        if asked:
            positions = range(prefix_len, len(row) - 1)
            assert [e.position for e in result.prompt_logprobs] == [p + 1 for p in positions], case
            for entry, p in zip(result.prompt_logprobs, positions):
                assert abs(entry.logprob - logp[p, row[p + 1]].item()) <= tolerance, case
    for lane in lanes:
        lane.close()
