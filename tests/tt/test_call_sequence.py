"""The device calls of eager, chunked and traced runs, checked against a RECORDING ttnn layer.

``RecordingTtnnDevice`` (tt_recording.py) stands in for ttnn's device side:
it records every transfer, trace call, deallocation and op, hands real host
tensors through, and returns zero placeholders for device ops. The model is
a ``RecordingModel`` (zeros of the contract's shape). So these tests check
sequencing and ownership, never values.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams, WarmupManifest
from prefill_core.values.errors import PrefillStateError
from prefill_shell.backends.base import Backend
from prefill_shell.device.contract import INPUT_TOKENS, SLOTS
from prefill_shell.device.ledger import Ownership
from prefill_shell.device.model import ModelSpec
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.tt.backend import TtnnBackend
from tests.helpers import build_runtime
from tests.tt.emulated_lanes import POLICY  # 128-token chunks: a 300-token row runs 3 (padded 512)
from tests.tt.tt_recording import RecordingKV, RecordingModel

SPEC = ModelSpec(
    vocab_size=64, hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=32, max_position=1024
)

BLOCK = 32
EAGER_INPUTS = 5  # tokens, start, slots, fill_table, then the final step's last_index
CHUNKED_INPUTS = 5  # per chunk: tokens, start, slots, fill_table, read_table (and once, the final last_index)
BODY_INPUTS_CHUNKED = 5  # what a replay refreshes: tokens, start, slots, fill_table, read_table


class Lane:
    """A runtime over the recording layer, with the call helpers the tests share."""

    def __init__(self, recording, ttnn):
        self.recording = recording
        self.model = RecordingModel(ttnn, SPEC)
        self.backend = TtnnBackend(recording.mesh, ttnn_module=recording)
        self.runtime = build_runtime(self.model, policy=POLICY, backend=self.backend, kv=RecordingKV(BLOCK, 64))
        self.executor = PrefillExecutor(self.runtime)

    @staticmethod
    def inputs(lengths, sampling=None):
        tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
        table = torch.full((len(lengths), 16), -1, dtype=torch.int32)
        block = 0
        for row, length in enumerate(lengths):
            tokens[row, :length] = torch.arange(1, length + 1) % SPEC.vocab_size
            need = -(-length // BLOCK)
            table[row, :need] = torch.arange(block, block + need, dtype=torch.int32)
            block += need
        return dict(
            tokens=tokens,
            page_table=table,
            prompt_lengths=list(lengths),
            sampling=None if sampling is None else [sampling] * len(lengths),
        )

    def eager(self, lengths, sampling=None):
        return self.runtime.prefill(**self.inputs(lengths, sampling))

    def traced(self, lengths, sampling=None):
        """Warms exactly what the call needs, then runs it traced; returns (results, first call index of the run)."""
        args = self.inputs(lengths, sampling)
        batch = self.runtime.prepare(**args)
        self.executor.warm_up(WarmupManifest().observe(batch.requests))
        mark = len(self.recording.calls)
        return self.executor.prefill(**args, mode="traced"), mark

    def uploaded(self, since=0):
        return [c.tensors[0] for c in self.recording.calls[since:] if c.name == "to_device"]

    def force_freed(self, since=0):
        return [c.tensors[0] for c in self.recording.calls[since:] if c.name == "deallocate" and c.kwargs["force"]]

    def sequence(self, names, since=0):
        return [c.name for c in self.recording.calls[since:] if c.name in names]


@pytest.fixture
def lane(recording, ttnn):
    return Lane(recording, ttnn)


def _same_objects(a, b) -> bool:
    return sorted(map(id, a)) == sorted(map(id, b))


def test_the_ttnn_backend_implements_the_backend_seam(lane):
    """TtnnBackend satisfies the runtime-checkable Backend protocol."""
    assert isinstance(lane.backend, Backend)


def test_eager_regular_run_uploads_each_input_once_and_releases_every_one(lane):
    """One to_device per step input, one body call, and every uploaded tensor is force-deallocated once."""
    results = lane.eager([100])
    rec = lane.recording
    uploaded = lane.uploaded()
    assert len(uploaded) == EAGER_INPUTS
    specs = sorted(c.args[0] for c in rec.calls if c.name == "to_device")
    assert ((1, 1, 1, 128), "UINT32", "ROW_MAJOR") in specs  # tokens
    freed = lane.force_freed()
    assert all(any(u is f for f in freed) for u in uploaded)
    assert len(freed) == len({id(f) for f in freed}), "a tensor was deallocated twice"
    assert [name for name, _ in lane.model.calls] == ["forward_hidden", "lm_head"]
    assert lane.backend.ledger.live() == []
    assert not any(n.endswith("trace") or "trace_capture" in n for n in rec.names())
    assert results[0].logits.shape == (SPEC.vocab_size,) and results[0].logits.dtype == torch.float32


def test_eager_chunked_run_stages_every_input_per_chunk_and_deallocates_each(lane):
    """A 3-chunk row: 3 x 5 body-input uploads plus one last-token index, 3 body calls with a read table."""
    lane.eager([300])
    uploaded = lane.uploaded()
    assert len(uploaded) == 3 * CHUNKED_INPUTS + 1
    bodies = [kw for name, kw in lane.model.calls if name == "forward_hidden"]
    assert len(bodies) == 3
    assert all(kw["read_table"] is not None for kw in bodies)
    assert all(kw["start"] == ((1,), "INT32", "ROW_MAJOR") for kw in bodies)  # a tensor, never a scalar
    freed = lane.force_freed()
    assert all(any(u is f for f in freed) for u in uploaded)
    assert len(freed) == len({id(f) for f in freed})
    assert len(freed) == len(uploaded) + 3 + 2  # + 3 hidden outputs + last_hidden and logits
    assert lane.backend.ledger.live() == []


def test_a_non_final_chunk_output_is_released_before_the_next_chunk_is_staged(lane):
    """The runner frees chunk i's hidden output before uploading chunk i+1's inputs."""
    lane.eager([300])
    names = lane.sequence({"to_device", "deallocate"})
    first_uploads = names.index("to_device", CHUNKED_INPUTS)  # a later chunk's first upload
    assert "deallocate" in names[CHUNKED_INPUTS : first_uploads + 1]


def test_readback_starts_every_transfer_then_synchronizes_once_per_invocation(lane):
    """Two invocations: non-blocking from_device for each output, then exactly one synchronize, twice."""
    lane.eager([100, 300])
    seq = lane.sequence({"from_device", "synchronize_device"})
    assert seq.count("synchronize_device") == 2
    first = seq.index("synchronize_device")
    assert first >= 1 and set(seq[:first]) == {"from_device"}
    assert seq[-1] == "synchronize_device" and set(seq[first + 1 : -1]) == {"from_device"}
    assert all(c.kwargs["blocking"] is False for c in lane.recording.calls if c.name == "from_device")


def test_traced_replay_of_three_chunks_issues_three_refresh_and_execute_rounds_and_no_allocation(lane):
    """Per chunk: 5 in-place copies then one non-blocking execute_trace; then the last-index copy; zero to_device."""
    _, mark = lane.traced([300])
    rec = lane.recording
    assert rec.count("to_device", since=mark) == 0
    assert rec.count("begin_trace_capture", since=mark) == 0
    seq = lane.sequence({"copy_host_to_device_tensor", "execute_trace"}, since=mark)
    round_ = ["copy_host_to_device_tensor"] * BODY_INPUTS_CHUNKED + ["execute_trace"]
    assert seq == round_ * 3 + ["copy_host_to_device_tensor"]
    executes = [c for c in rec.calls[mark:] if c.name == "execute_trace"]
    assert all(c.kwargs == {"cq_id": 0, "blocking": False} for c in executes)
    assert rec.count("synchronize_device", since=mark) == 1


def test_a_replay_runs_no_python_body_only_the_postprocessing(lane):
    """A ttnn trace replays device commands: while serving, only the eager LM head runs in Python."""
    lane.traced([300])
    compile_run, warm_run, capture_run, serving = (
        ["forward_hidden", "lm_head"],
        ["forward_hidden"],
        ["forward_hidden"],
        ["lm_head"],
    )
    assert [name for name, _ in lane.model.calls] == compile_run + warm_run + capture_run + serving


def test_capture_runs_the_body_warm_then_inside_one_capture_with_no_host_writes(lane):
    """Workspaces and trace inputs are uploaded before the capture; the capture holds the body and its copy."""
    _, mark = lane.traced([100])
    warm = lane.recording.names()[:mark]
    begin, end = warm.index("begin_trace_capture"), warm.index("end_trace_capture")
    assert "to_device" not in warm[begin:end] and "copy_host_to_device_tensor" not in warm[begin:end]
    assert "copy" in warm[begin:end]  # assign: the body's output into the persistent hidden
    assert "to_device" not in warm[end:]
    assert lane.backend.captures == 1


def test_close_releases_every_trace_and_every_persistent_tensor(lane):
    """After a traced run, close() releases the trace and frees all trace inputs and workspaces."""
    lane.traced([300])
    assert lane.backend.ledger.live(Ownership.TRACE)
    lane.executor.close()
    rec = lane.recording
    assert rec.count("release_trace") == 1 and rec.released == rec.captured
    assert lane.backend.ledger.live() == []
    freed = lane.force_freed()
    assert all(any(u is f for f in freed) for u in lane.uploaded())


def test_sampled_eager_run_stages_k_p_t_for_ttnn_sampling_and_frees_them(lane):
    """Top-k sampling: topk candidates, ttnn.sampling with K/P/T device tensors, then log-probs; nothing stays live."""
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, num_logprobs=2)
    results = lane.eager([100, 90], sampling=params)
    rec = lane.recording
    assert rec.count("sampling") == 1
    sampling = next(c for c in rec.calls if c.name == "sampling")
    assert sampling.kwargs["k"] == ((2,), "UINT32", "ROW_MAJOR")
    assert sampling.kwargs["p"] == ((2,), "BFLOAT16", "ROW_MAJOR")
    assert sampling.kwargs["temp"] == ((2,), "BFLOAT16", "ROW_MAJOR")
    assert sampling.kwargs["seed"] == 3
    assert rec.count("to_device") == EAGER_INPUTS + 3
    assert rec.count("topk") == 2  # 32 sampling candidates, then the top-2 log-probs
    assert rec.count("moreh_logsoftmax") == 1 and rec.count("gather") == 1
    assert lane.backend.ledger.live() == []
    assert [r.token for r in results] == [0, 0]  # placeholders: the recording never computes
    assert all(len(r.top_logprobs) == 2 for r in results)


def test_greedy_rows_take_the_device_argmax_path(lane):
    """All-greedy rows run ttnn.argmax on row-major logits and never ttnn.sampling."""
    lane.eager([100], sampling=SamplingParams.greedy())
    rec = lane.recording
    assert rec.count("argmax") == 1 and rec.count("sampling") == 0


def test_traced_sampling_assigns_every_output_into_the_alias_workspace(lane):
    """A traced top-k run uploads nothing: K/P/T are refreshed in place, every output is copied into the workspace."""
    params = SamplingParams(temperature=1.0, top_k=4, num_logprobs=3)
    results, mark = lane.traced([100], sampling=params)
    rec = lane.recording
    assert rec.count("to_device", since=mark) == 0
    # 4 body inputs before the replay, then the last-token index and K, P, 1/T
    assert lane.sequence({"copy_host_to_device_tensor", "execute_trace"}, since=mark) == [
        *["copy_host_to_device_tensor"] * 4,
        "execute_trace",
        *["copy_host_to_device_tensor"] * 4,
    ]
    sampling = next(c for c in rec.calls[mark:] if c.name == "sampling")
    assert (sampling.kwargs["k"], sampling.kwargs["temp"]) == (
        ((1,), "UINT32", "ROW_MAJOR"),
        ((1,), "BFLOAT16", "ROW_MAJOR"),
    )
    copies = [c for c in rec.calls[mark:] if c.name == "copy"]
    assert len(copies) == 6  # last_hidden, logits, tokens, token_logprob, top_ids, top_logprobs
    assert results[0].token == 0 and len(results[0].top_logprobs) == 3


def test_a_failed_deallocate_leaves_the_handle_live_for_a_retry(lane):
    """ttnn.deallocate raising propagates before the ledger changes; the handle stays live and a retry frees it."""
    handle = lane.backend.upload(torch.zeros(4, dtype=torch.int64), SLOTS, Ownership.INVOCATION)
    lane.recording.fail_deallocate = 1
    with pytest.raises(RuntimeError, match="injected"):
        lane.backend.release(handle)
    assert not handle.released and handle in lane.backend.ledger.live()
    lane.backend.release(handle)
    assert handle.released and lane.backend.ledger.live() == []


def test_a_failed_free_during_a_run_becomes_an_orphan_and_nothing_leaks(lane):
    """The runtime keeps the handle whose free failed and frees it later: no live tensor after cleanup."""
    lane.recording.fail_deallocate = 1
    lane.eager([100])
    assert len(lane.runtime.orphans) == 1
    lane.runtime.cleanup()
    assert lane.runtime.orphans == [] and lane.backend.ledger.live() == []


def test_refresh_refuses_a_host_value_of_another_shape(lane):
    """copy_host_to_device_tensor needs equal specs: a mismatch is a PrefillStateError, not a device fault."""
    target = lane.backend.upload(torch.zeros(1, 128, dtype=torch.int64), INPUT_TOKENS, Ownership.TRACE)
    with pytest.raises(PrefillStateError, match="refresh of input_tokens"):
        lane.backend.refresh(torch.zeros(1, 64, dtype=torch.int64), target)
    assert lane.recording.count("copy_host_to_device_tensor") == 0


def test_a_released_trace_cannot_be_replayed_or_released_again(lane):
    """Replay or a second release of a released trace is a PrefillStateError, and ttnn is not called."""
    handle = lane.backend.capture("k", lambda: None)
    lane.backend.release_trace(handle)
    with pytest.raises(PrefillStateError, match="replayed after it was released"):
        lane.backend.replay(handle)
    with pytest.raises(PrefillStateError, match="released twice"):
        lane.backend.release_trace(handle)
    assert lane.recording.count("execute_trace") == 0 and lane.recording.count("release_trace") == 1


def test_a_body_failure_during_capture_closes_and_frees_the_capture(lane):
    """The body's error propagates; the half-made capture is ended and released."""
    runs = []

    def body():
        runs.append(1)
        if len(runs) == 2:
            raise ValueError("body failed inside the capture")

    with pytest.raises(ValueError, match="inside the capture"):
        lane.backend.capture("k", body)
    assert lane.sequence({"begin_trace_capture", "end_trace_capture", "release_trace"}) == [
        "begin_trace_capture",
        "end_trace_capture",
        "release_trace",
    ]
    assert lane.recording.capturing is None
