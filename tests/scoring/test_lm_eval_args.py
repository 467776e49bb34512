"""prefill-runtime's lm-eval model arguments: a count not an int >= 1 or a switch not a bool is a named error."""

from __future__ import annotations

import sys

import pytest
import torch

from prefill_core.values.errors import PrefillConfigError

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="lm-eval is tested on 3.12")


@pytest.fixture(scope="module")
def model_class():
    pytest.importorskip("lm_eval")
    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    return PrefillRuntimeLM


@pytest.mark.parametrize(
    "name, value",
    [("max_length", "abc"), ("max_length", 0), ("max_length", 2.5), ("block_size", 0), ("block_size", "x")]
    + [("block_size", 3), ("block_size", 1024), ("device", "foo")]
    + [("max_chunk", 0), ("num_blocks", -4), ("traced", "maybe"), ("max_length", "²"), ("max_length", 10**9)]
    + [("dtype", "int8"), ("dtype", "float64")],
)
def test_a_bad_model_argument_is_a_config_error_naming_it(model_class, name, value):
    """ValueError/ZeroDivisionError from int() or the layout before; max_length=0 silently meant the default."""
    with pytest.raises(PrefillConfigError, match=f"model argument {name}="):
        model_class(model="random:tiny", **{name: value})


def test_model_arguments_as_lm_eval_passes_them_are_taken(model_class):
    """Digit strings and true/false strings, as lm-eval's --model_args parser may hand them over, are read."""
    lm = model_class(model="random:tiny", max_length="64", block_size="16", max_chunk=64, traced="True")
    assert lm.max_length == 64 and lm.scorer.block_size == 16 and lm.scorer.mode == "traced"


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--model_args", "model=random:tiny,block_size=3"], "model argument block_size=3 is invalid: must be a power"),
        (["--model_args", "model=random:tiny,max_chunk=0"], "model argument max_chunk=0 is invalid"),
        (["--model_args", "model=random:tiny", "--device", "foo"], "model argument device='foo' is invalid"),
    ],
    ids=["block_size", "max_chunk", "device"],
)
def test_the_lm_eval_wrapper_names_a_bad_model_argument_and_exits_2(model_class, monkeypatch, capsys, extra, named):
    """prefill-lm-eval checks prefill-runtime's arguments as the other command lines do: one error line, exit 2,
    before lm-eval loads a task or the model (it was lm-eval's traceback and exit 1)."""
    from prefill_shell.cli.lm_eval_harness import main

    argv = ["prefill-lm-eval", "--model", "prefill-runtime", *extra, "--tasks", "no_such_task"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        main()
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"error: --model_args: prefill-runtime {named}" in err, err


@pytest.mark.parametrize("dtype, expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_dtype_as_lm_eval_hf_takes_it_loads_the_model_in_it(model_class, dtype, expected):
    """dtype=bfloat16 (lm-eval's hf spelling) runs the model and its KV pool in bfloat16; the default is float32."""
    lm = model_class(model="random:tiny", max_length=64, dtype=dtype)
    assert lm.model.dtype == expected and lm.scorer.runtime.config.kv.dtype == expected
    assert lm.dtype_choice.dtype == dtype
    assert lm.scorer.score([([1, 2, 3], [4, 5])])[0].logprob < 0
    assert model_class(model="random:tiny", max_length=64).model.dtype == torch.float32
