"""The tensor contract: every staged tensor has the shape and dtype its spec states for its program."""

from __future__ import annotations

import torch
from hypothesis import given

from prefill_core import PrefillProgramSignature, prepare_prefill
from prefill_shell.device.contract import (
    ALL_SPECS,
    BODY_INPUTS,
    GROUPED_INPUTS,
    READ_TABLE,
    STEP_INPUTS,
    Stage,
    body_geometry,
    output_specs,
    program_geometry,
    workspace_specs,
)
from prefill_shell.engine.steps.inputs import build_host_steps
from prefill_shell.engine.steps.trace import warmup_step
from tests.strategies import cases

HIDDEN = 16


def _tokens(case) -> torch.Tensor:
    return torch.ones(len(case.batch), max(case.batch.lengths), dtype=torch.int64)


@given(cases())
def test_every_host_step_matches_its_programs_contract_shapes_and_dtypes(case):
    """Each step input has spec.shape(body geometry) and the spec's host dtype, so equal programs stage equal forms."""
    seen: dict[PrefillProgramSignature, tuple] = {}
    for prepared in prepare_prefill(case.batch, case.policy, case.layout):
        signature = prepared.program_signature
        geometry = body_geometry(signature.body, HIDDEN)
        for step in build_host_steps(_tokens(case), prepared.request):
            assert (READ_TABLE in step) == prepared.request.kind.is_chunked
            forms = tuple(
                (spec.name, tuple(step[spec].shape), step[spec].dtype) for spec in STEP_INPUTS if spec in step
            )
            for spec in step:
                assert tuple(step[spec].shape) == spec.shape(geometry), spec
                assert step[spec].dtype == spec.host_dtype, spec
            assert seen.setdefault(signature, forms) == forms


@given(cases())
def test_a_warmup_step_has_the_bodys_forms_and_writes_nothing(case):
    """The no-write warm-up step of a body has every body input's contract form, all fill entries and slots -1."""
    for prepared in prepare_prefill(case.batch, case.policy, case.layout):
        body = prepared.program_signature.body
        step = warmup_step(body, HIDDEN)
        geometry = body_geometry(body, HIDDEN)
        for spec in step:
            assert tuple(step[spec].shape) == spec.shape(geometry) and step[spec].dtype == spec.host_dtype
        single = {s for s in BODY_INPUTS if s is not READ_TABLE and s not in GROUPED_INPUTS}  # no KV groups here
        assert {spec for spec in BODY_INPUTS if spec in step} == single | (
            {READ_TABLE} if body.read_table_width else set()
        )
        assert all(int(v) == -1 for spec in step if spec.name in ("fill_table", "slots") for v in step[spec].flatten())


def test_contract_names_are_unique_and_input_and_sampled_tokens_differ():
    """Each tensor is named once; the token matrix a body reads and the tokens sampling returns are two entries."""
    names = [spec.name for spec in ALL_SPECS]
    assert len(names) == len(set(names))
    assert "input_tokens" in names and "sampled_tokens" in names


@given(cases())
def test_workspaces_hold_exactly_what_a_program_outputs_and_reads_after_the_body(case):
    """A program alias's workspace is its postprocess inputs plus its outputs; logits paths return logits only."""
    for prepared in prepare_prefill(case.batch, case.policy, case.layout):
        signature = prepared.program_signature
        outputs = output_specs(signature)
        assert all(spec.stage is Stage.OUTPUT for spec in outputs)
        assert set(outputs) <= set(workspace_specs(signature))
        assert all(spec.stage in (Stage.OUTPUT, Stage.POSTPROCESS_INPUT) for spec in workspace_specs(signature))
        names = {spec.name for spec in outputs}
        if signature.sampling_path.returns_logits:
            assert names == {"last_hidden", "logits"}
        else:
            assert {"sampled_tokens", "token_logprob"} <= names
            assert ({"top_ids", "top_logprobs"} <= names) == signature.logprobs
        geometry = program_geometry(signature, HIDDEN, 64, case.policy.max_logprobs)
        assert all(spec.shape(geometry)[0] == signature.padded_batch for spec in workspace_specs(signature))
