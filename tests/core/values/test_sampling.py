"""Per-row sampling rules of ``prefill_core.values.sampling`` that the shell's entries share."""

from __future__ import annotations

import pytest

from prefill_core import SamplingParams
from prefill_core.values.errors import InvalidSamplingError
from prefill_core.values.sampling import refuse_per_row_extras


def test_a_batch_shaped_result_refuses_top_and_prompt_log_probs_by_row():
    """refuse_per_row_extras (the one copy of the rule) names the first row asking top or prompt log-probs."""
    refuse_per_row_extras(range(3), [None, SamplingParams.greedy(), SamplingParams(top_k=2)])
    with pytest.raises(InvalidSamplingError) as raised:
        refuse_per_row_extras([4, 7], [None, SamplingParams.greedy(num_logprobs=2)])
    assert raised.value.row == 7 and raised.value.field == "sampling.num_logprobs"
    with pytest.raises(InvalidSamplingError) as raised:
        refuse_per_row_extras([0], [SamplingParams(prompt_logprobs=1)])
    assert raised.value.field == "sampling.prompt_logprobs"
