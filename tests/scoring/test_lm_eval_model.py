"""``PrefillRuntimeLM``'s tokenization against lm-eval's own ``HFLM`` methods, on SmolLM2's tokenizer.

SmolLM2's tokenizer adds no special tokens; a copy whose post-processor adds
BOS (as Llama's tokenizers do) shows the BOS rules.

``HFLM.tok_encode`` and ``HFLM.prefix_token_id`` are called unbound on a
stand-in holding only what they read (the tokenizer, ``add_bos_token``,
``custom_prefix_token_id``), so no second model loads.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from prefill_core.values.errors import PrefillConfigError

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="lm-eval is tested on 3.12")


@pytest.fixture(scope="module")
def classes():
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    return HFLM, PrefillRuntimeLM


@pytest.fixture(scope="module")
def bos_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer with a post-processor that adds its BOS, as a Llama tokenizer does."""
    import copy

    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    bos, bos_id = smollm2_tokenizer.bos_token, smollm2_tokenizer.bos_token_id
    backend = copy.deepcopy(smollm2_tokenizer.backend_tokenizer)
    backend.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=smollm2_tokenizer.eos_token)
    assert tokenizer.encode("hi")[0] == bos_id
    return tokenizer


@pytest.fixture(params=["smollm2", "adds_bos"])
def tokenizer(request, smollm2_tokenizer):
    return smollm2_tokenizer if request.param == "smollm2" else request.getfixturevalue("bos_tokenizer")


def _pair(classes, tokenizer, add_bos_token):
    hflm_class, ours_class = classes
    hf = SimpleNamespace(tokenizer=tokenizer, add_bos_token=add_bos_token, custom_prefix_token_id=None)
    hf.prefix_token_id = hflm_class.prefix_token_id.fget(hf)
    ours = object.__new__(ours_class)  # the tokenization state only: no model loads
    ours.tokenizer, ours._model_name, ours.add_bos_token = tokenizer, "smollm2", add_bos_token
    return hf, ours


TEXTS = ["The capital of France is", "", " a leading space", "{bos}The capital", "{bos}", "{eos}after eos", "x{bos}"]


@pytest.mark.parametrize("add_bos_token", [None, True, False])
@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_tok_encode_equals_hflms_on_every_rule(classes, tokenizer, add_bos_token, add_special_tokens):
    """Text starting with BOS gets no second BOS; add_special_tokens, then add_bos_token, then the tokenizer;
    left_truncate_len keeps the last ids."""
    hflm_class, _ = classes
    hf, ours = _pair(classes, tokenizer, add_bos_token)
    assert ours.prefix_token_id == hf.prefix_token_id
    bos, eos = tokenizer.decode(hf.prefix_token_id), tokenizer.eos_token
    for text in (t.format(bos=bos, eos=eos) for t in TEXTS):
        for truncate in (None, 2):
            expected = hflm_class.tok_encode(
                hf, text, add_special_tokens=add_special_tokens, left_truncate_len=truncate
            )
            got = ours.tok_encode(text, add_special_tokens=add_special_tokens, left_truncate_len=truncate)
            assert got == expected, (text, truncate)


def test_a_text_that_starts_with_bos_gets_no_second_bos(classes, bos_tokenizer):
    """The issue's case: a context beginning with the BOS text, BOS added once (was twice)."""
    _, ours = _pair(classes, bos_tokenizer, None)
    bos_id = ours.prefix_token_id
    bos = bos_tokenizer.decode(bos_id)
    ids = ours.tok_encode(bos + "The capital of France is")
    assert ids.count(bos_id) == 1 and ids[0] == bos_id


def test_add_bos_token_is_a_checked_model_argument(classes):
    """add_bos_token was swallowed by **kwargs; now read as lm-eval passes it, and a bad value is named."""
    _, ours_class = classes
    assert ours_class(model="random:tiny", add_bos_token="False").add_bos_token is False
    with pytest.raises(PrefillConfigError, match="model argument add_bos_token='maybe'"):
        ours_class(model="random:tiny", add_bos_token="maybe")
