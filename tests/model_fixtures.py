"""Fixtures of the shell's tests: the tiny model, its HF oracle and the real SmolLM2 (helpers: tests/helpers.py).

Registered for every folder by ``tests/conftest.py``, so each session-scoped value is built once per run.

The oracle is ``transformers.LlamaForCausalLM`` loaded in float32 from the
very weights the reference model holds; each row is run through it alone,
unpadded, so every runtime result is compared with an independent answer.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from prefill_shell.reference import random_llama, save_hf_folder
from prefill_shell.reference.loading.gguf import load_gguf
from prefill_shell.reference.loading.smollm2 import ENV_VAR, ModelFileMissingError, smollm2_path
from tests import helpers

__all__ = [
    "kit",
    "lm_eval_harness",
    "mmlu_hf_reference",
    "one_torch_thread",
    "oracle",
    "smollm2",
    "smollm2_file",
    "smollm2_hf",
    "smollm2_loaded_once",
    "smollm2_tokenizer",
    "tiny_model",
    "tiny_smollm2_vocab",
]


@pytest.fixture(scope="session")
def tiny_model():
    """The seeded tiny preset, with positions for 8192 tokens so a 5000-token row fits its capacity."""
    return random_llama(0, "tiny", max_position_embeddings=8192)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread while a module runs (modules opt in with ``usefixtures``): their many small steps pay for a
    second intra-op thread on a shared 2-core machine, where it spin-waits for a descheduled partner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def oracle(tiny_model, tmp_path_factory):
    """An ``Oracle`` over transformers' Llama holding ``tiny_model``'s weights."""
    transformers = pytest.importorskip("transformers")
    folder = save_hf_folder(tiny_model, tmp_path_factory.mktemp("tiny_hf"))
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return Oracle(hf)


class Oracle:
    """Runs one unpadded row through HF and memoizes its last-token logits and KV cache."""

    def __init__(self, hf):
        self.hf = hf
        self._memo: dict[tuple[int, ...], tuple[torch.Tensor, list, list]] = {}

    def _run(self, tokens: torch.Tensor):
        key = tuple(tokens.tolist())
        if key not in self._memo:
            with torch.no_grad():
                out = self.hf(tokens[None], use_cache=True)
            cache = out["cache"] if "cache" in out else out["past_key_values"]
            keys = [layer.keys[0].clone() for layer in cache.layers]  # [H_kv, S, D] per layer
            values = [layer.values[0].clone() for layer in cache.layers]
            self._memo[key] = (out.logits[0, -1].clone(), keys, values)
        return self._memo[key]

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 ``[V]`` logits of the row's last token."""
        return self._run(tokens)[0]

    def kv(self, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the row's post-RoPE keys and values ``[H_kv, len, D]``."""
        _, keys, values = self._run(tokens)
        return keys, values


@pytest.fixture(scope="session")
def kit():
    """tests.helpers as one fixture, kept while tests still take ``kit`` (new tests import from tests.helpers)."""
    return helpers


# -- the real SmolLM2 (its pinned GGUF) and transformers on the same file: loaded once a session ----------


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    """The pinned GGUF (sha256 checked); skipped only when nothing points at it and the cache lacks it."""
    try:
        return smollm2_path()
    except ModelFileMissingError as missing:
        if os.environ.get(ENV_VAR):
            raise
        pytest.skip(f"{missing} (make test fetches it)")


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """Our reference Llama holding the file's weights, dequantized to float32."""
    pytest.importorskip("gguf")
    return load_gguf(smollm2_file, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_file):
    """transformers' tokenizer rebuilt from the file's metadata."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_file):
    """transformers' Llama loaded from the same file (its own dequantization), float32."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_file.parent, gguf_file=smollm2_file.name, dtype=torch.float32
    ).eval()


_HAS_TOKENIZER: dict[Path, bool] = {}
"""``gguf_has_tokenizer``'s answer for the pinned file, asked once a session (the file is checked by its sha256)."""


@contextlib.contextmanager
def smollm2_loads_reused(smollm2_file: Path, smollm2, smollm2_tokenizer):
    """While open, the shell's loads of the pinned GGUF (``reference.text``'s ``load_gguf`` in float32 on the CPU,
    its tokenizer through transformers, the tokenizer check) return what the session already made by those very calls
    on that very file, instead of parsing it again (a parse decodes its 49k-token vocabulary, and the weights are
    de-quantized on every load). Everything above those leaves runs as it does for a caller: the path, its kind,
    the dtype, the runtime. Any other file, dtype or device loads as before. Yields the loads it served
    (``"weights"``, ``"tokenizer"``), so a test shows that its command did ask for the file."""
    import transformers

    from prefill_shell.reference.loading import text

    file = Path(smollm2_file).resolve()
    served: list[str] = []
    real_load, real_check = text.load_gguf, text.gguf_has_tokenizer
    real_tokenizer = transformers.AutoTokenizer.from_pretrained

    def load_gguf(path, dtype=torch.float32, device="cpu"):
        if Path(path).resolve() == file and dtype == torch.float32 and str(device) == "cpu":
            served.append("weights")
            return smollm2
        return real_load(path, dtype=dtype, device=device)

    def gguf_has_tokenizer(path):
        if Path(path).resolve() != file:
            return real_check(path)
        if file not in _HAS_TOKENIZER:
            _HAS_TOKENIZER[file] = real_check(path)
        return _HAS_TOKENIZER[file]

    def from_pretrained(folder, *args, gguf_file=None, **kwargs):
        if gguf_file is not None and not args and not kwargs and (Path(folder) / gguf_file).resolve() == file:
            served.append("tokenizer")
            return smollm2_tokenizer
        return real_tokenizer(folder, *args, gguf_file=gguf_file, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(text, "load_gguf", load_gguf)
        patch.setattr(text, "gguf_has_tokenizer", gguf_has_tokenizer)
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
        yield served


@pytest.fixture
def smollm2_loaded_once(smollm2_file, smollm2, smollm2_tokenizer):
    """``smollm2_loads_reused`` for one test: the list of the loads it served."""
    with smollm2_loads_reused(smollm2_file, smollm2, smollm2_tokenizer) as served:
        yield served


# -- lm-eval (3.12 only): imported once a session, with a task index of this repository's evals alone --------


@pytest.fixture(scope="session")
def lm_eval_harness():
    """``(lm_eval.evaluator, TaskManager)`` with prefill-runtime registered, shared by every lm-eval test.

    The task index holds ``evals/`` only (``include_defaults=False``): indexing lm-eval's thousands of bundled
    task files is its slowest start-up step, and these tests run the repository's own tasks.
    """
    from tests.lm_eval_kit import LM_EVAL_OFFLINE, REPO

    os.environ.update(LM_EVAL_OFFLINE)
    try:
        from lm_eval import evaluator
    except ImportError as error:  # lm-eval imports; its evaluator needs datasets -> pyarrow, which may want numpy 2
        pytest.skip(f"lm-eval's evaluator does not import in this environment: {error}")
    from lm_eval.tasks import TaskManager

    import prefill_shell.scoring.lm_eval_model  # noqa: F401 (registers prefill-runtime)

    return evaluator, TaskManager(include_path=str(REPO / "evals"), include_defaults=False)


@pytest.fixture(scope="session")
def tiny_smollm2_vocab(smollm2_tokenizer, tmp_path_factory):
    """A seeded random transformers Llama with SmolLM2's vocabulary, saved with SmolLM2's tokenizer: ``(folder,
    model)``. Tiny, so an lm-eval task of a hundred ~300-token documents runs in seconds on both sides."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(34)
    config = transformers.LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,  # far from uniform log-probs, so a wrong position or mask shows in the numbers
        bos_token_id=smollm2_tokenizer.bos_token_id,
        eos_token_id=smollm2_tokenizer.eos_token_id,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny_smollm2_vocab")
    hf.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="session")
def mmlu_hf_reference(lm_eval_harness, tiny_smollm2_vocab, smollm2_tokenizer):
    """lm-eval's ``hf`` model's prefill_mmlu results on ``tiny_smollm2_vocab``: the reference every prefill-runtime
    run of the task is compared with, computed once."""
    from lm_eval.models.huggingface import HFLM

    from tests.lm_eval_kit import BATCH_SIZE, MMLU_MAX_LENGTH, mmlu_evaluate

    evaluator, task_manager = lm_eval_harness
    _, model = tiny_smollm2_vocab
    hf = HFLM(pretrained=model, tokenizer=smollm2_tokenizer, max_length=MMLU_MAX_LENGTH, batch_size=BATCH_SIZE)
    return mmlu_evaluate(evaluator, task_manager, hf)
