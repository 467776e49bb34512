"""lm-evaluation-harness as the scoring client: the ``prefill-runtime`` model.

``PrefillRuntimeLM`` is an lm-eval ``TemplateLM``: lm-eval's own code turns
requests into token ids (``_encode_pair``, the empty-context prefix token)
and this class scores them on the runtime through ``scoring.Scorer``:
``loglikelihood`` pairs with shared contexts computed once, and
``loglikelihood_rolling`` over lm-eval's own rolling windows
(``get_rolling_token_windows`` + ``make_disjoint_window``). It is a prefill
engine: ``generate_until`` raises.

lm-eval finds models only in its registry; importing this package registers
the class as ``prefill-runtime``. ``python -m prefill_shell.cli.lm_eval_harness <lm-eval
arguments>`` does that, then runs lm-eval's own command line.

Model arguments (``--model_args``): ``model`` (a .gguf file, a Hugging Face
folder, ``random:NAME``, or ``smollm2``/empty for the pinned SmolLM2),
``max_length`` (lm-eval's window and truncation length; default the model's
positions minus one), ``block_size`` (16), ``max_chunk`` (the runtime's
longest step, default 2048), ``num_blocks`` (KV pool size), ``traced``,
``dtype`` (as lm-eval's ``hf`` model takes it: ``float32``, the default,
``bfloat16``, ``float16``, or ``auto`` for the checkpoint's dtype; plus
``native``: bfloat16 where the device computes it natively, else float32;
``prefill_core.values.dtype`` holds the rules). ``self.dtype_choice`` says which
dtype it resolved to and why. ``add_bos_token`` (true/false; default the
tokenizer's own) as lm-eval's ``hf`` model takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch

from prefill_core import ExecutionMode
from prefill_core.inputs.options import OptionError, block_size_option, count_option
from prefill_core.values.dtype import canonical_dtype
from prefill_core.values.errors import PrefillConfigError, PrefillError
from prefill_shell.backends import TorchBackend
from prefill_shell.extras import LM_EVAL_PYTHONS, requires_extra
from prefill_shell.reference.loading.text import load_model, load_tokenizer, model_dtype
from prefill_shell.scoring.scorer import Scorer, window_length
from prefill_shell.scoring.setup import scoring_runtime

with requires_extra("lm-eval", __name__, pythons=LM_EVAL_PYTHONS):
    import lm_eval.models  # noqa: F401 (lm-eval fills its registry from this import only while the registry is empty)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

__all__ = ["ModelOptions", "PrefillRuntimeLM", "check_model_arguments"]

T = TypeVar("T")

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no", "")


def _model_option(name: str, value: Any, check: Callable[[Any], T], default: T | None) -> T | None:
    """A ``--model_args`` value by ``prefill_core.inputs.options``' ``check`` (the command lines' own); None or "" is
    ``default``; a value the check refuses names the argument."""
    if value is None or value == "":
        return default
    try:
        return check(value)
    except OptionError as error:
        raise PrefillConfigError(f"prefill-runtime model argument {name}={value!r} is invalid: {error}") from None


def _flag_option(value: Any) -> bool:
    """A switch: a bool, or one of true/false, yes/no, 1/0 in any case."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in _TRUE + _FALSE:
        raise OptionError("must be true or false")
    return text in _TRUE


def _device_option(value: Any) -> str:
    """A torch device this process can use; lm-eval's command line passes ``cuda`` unless told otherwise, and on
    a machine without CUDA that default is not a request the caller made, so the CPU serves it."""
    device = str(value)
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "cpu"
    try:
        TorchBackend(device)
    except PrefillError as error:
        raise OptionError(f"cannot be used: {str(error).split(': ', 1)[-1]}") from None
    return device


@attrs.frozen
class ModelOptions:
    """prefill-runtime's model arguments, checked (``check_model_arguments``) before any model loads."""

    max_length: int | None
    block_size: int
    max_chunk: int
    num_blocks: int | None
    traced: bool
    device: str


def check_model_arguments(
    max_length: Any = None,
    block_size: Any = 16,
    max_chunk: Any = 2048,
    num_blocks: Any = None,
    traced: Any = False,
    device: Any = None,
    **_ignored: Any,
) -> ModelOptions:
    """The model arguments as values; the first one that breaks its rule is a ``PrefillConfigError`` naming it."""
    return ModelOptions(
        _model_option("max_length", max_length, count_option, None),
        _model_option("block_size", block_size, block_size_option, 16),
        _model_option("max_chunk", max_chunk, count_option, 2048),
        _model_option("num_blocks", num_blocks, count_option, None),
        _model_option("traced", traced, _flag_option, False),
        _model_option("device", device, _device_option, "cpu"),
    )


def _model_ref(model: str | None) -> str | None:
    return None if model in (None, "", "smollm2") else str(model)


@register_model("prefill-runtime")
class PrefillRuntimeLM(TemplateLM):
    """lm-eval's ``LM`` on the prefill runtime (torch backend)."""

    def __init__(
        self,
        model: str | None = None,
        max_length: int | None = None,
        block_size: int = 16,
        max_chunk: int = 2048,
        num_blocks: int | None = None,
        traced: bool | str = False,
        device: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        dtype: str | torch.dtype | None = None,
        add_bos_token: bool | str | None = None,
        **_ignored: Any,
    ):
        super().__init__()
        self.add_bos_token = _model_option("add_bos_token", add_bos_token, _flag_option, None)
        options = check_model_arguments(max_length, block_size, max_chunk, num_blocks, traced, device)
        ref = _model_ref(model)
        request = canonical_dtype(
            "float32" if dtype in (None, "") else str(dtype), "prefill-runtime model argument dtype"
        )
        self.dtype_choice = model_dtype(ref, request, options.device)
        self.model = load_model(
            ref, dtype=self.dtype_choice.dtype, device=options.device, block_size=options.block_size
        )
        self.tokenizer = load_tokenizer(ref)
        self._model_name = model
        spec = self.model.spec
        self._max_length = window_length(
            options.max_length, spec.max_position, "prefill-runtime model argument max_length"
        )
        runtime = scoring_runtime(
            self.model,
            options.device,
            max_length=self._max_length,
            block_size=options.block_size,
            max_chunk=options.max_chunk,
            num_blocks=options.num_blocks,
        )
        rows = int(batch_size) if str(batch_size).isdecimal() else 32
        mode = ExecutionMode.TRACED if options.traced else ExecutionMode.AUTO
        self.scorer = Scorer(runtime, max_length=self._max_length, max_rows=max(rows, 1), mode=mode)

    # -- what TemplateLM asks for ----------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # As lm-eval's HF backend: the BOS token when the tokenizer has one, else EOS.
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """lm-eval's ``hf`` rules (EleutherAI/lm-evaluation-harness ``lm_eval/models/huggingface.py``,
        ``HFLM.tok_encode``, as installed in the 3.12 venv), each checked against that method in
        ``tests/scoring/test_lm_eval_model.py``:

        * ``add_special_tokens`` given wins; else the ``add_bos_token`` model argument, if given; else the
          tokenizer's own default;
        * with ``add_special_tokens`` not given, a text that already starts with the prefix token's text
          (BOS, else EOS) gets no special tokens: never a second BOS;
        * ``left_truncate_len`` keeps the last that many ids.
        """
        if self.tokenizer is None:  # a random preset (or a file without one) still scores token ids, never text
            msg = f"prefill-runtime model {self._model_name!r} has no tokenizer: lm-eval's requests are text"
            raise PrefillConfigError(msg)
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special = False
        ids = (
            self.tokenizer.encode(string)
            if special is None
            else self.tokenizer.encode(string, add_special_tokens=special)
        )
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        scores = self.scorer.score([(context, continuation) for _, context, continuation in requests])
        answers = [(score.logprob, score.is_greedy) for score in scores]
        for (request, _, _), answer in zip(requests, answers):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        documents = [
            [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            for (string,) in (request.args for request in requests)
        ]
        scores = self.scorer.score([window for windows in documents for window in windows])
        totals, at = [], 0
        for windows, request in zip(documents, requests):
            total = sum(score.logprob for score in scores[at : at + len(windows)])
            at += len(windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
            totals.append(total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(
            "prefill-runtime is a prefill engine: it scores (loglikelihood, loglikelihood_rolling) and does not "
            "generate; run generation tasks with another lm-eval model"
        )
