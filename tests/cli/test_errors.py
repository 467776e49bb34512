"""The CLI in-process on bad invocations: one `error:` line naming the subject, exit 2 for usage and 1 otherwise."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from prefill_shell.cli.main import main
from prefill_shell.reference import random_llama, save_hf_folder
from prefill_shell.reference.loading.text import read_prompt_file

pytest.importorskip("gguf")
from tests.reference.loading.test_gguf import write_llama_gguf

TINY = ["run", "--model", "random:tiny"]
SCORE = ["score", "--model", "random:tiny", "--pairs", "{pairs}"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every damaged or odd file the table names, built once."""
    root = tmp_path_factory.mktemp("cli")

    def put(name: str, data: bytes | str) -> str:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(path)

    gguf = root / "tiny.gguf"
    write_llama_gguf(gguf, layers=1)  # a Llama GGUF with no tokenizer metadata
    folder = save_hf_folder(random_llama(0, "tiny"), root / "hf")
    _add_word_tokenizer(folder)
    weights = (folder / "model.safetensors").read_bytes()
    return {
        "ids": put("ids.txt", "1 2 3\n"),
        "pairs": put("pairs.jsonl", '{"context": "a", "continuation": "b"}\n'),
        "ids2": put("ids2.txt", "4 5 6 7\n"),
        "empty": put("empty.txt", ""),
        "blank": put("blank.txt", "\n   \n\t\n"),
        "latin1": put("latin1.txt", b"caf\xe9\n"),
        "bad_ids": put("bad_ids.txt", "1 2 3\n4 x 6\n"),
        "negative_ids": put("neg.txt", "1 -2 3\n"),
        "big_id": put("big.txt", "1 2 999999\n"),
        "too_long": put("long.txt", " ".join(["7"] * 4097) + "\n"),
        "bad_jsonl": put("p.JSONL", '{"prompt": "a"}\n{"oops": 1}\n'),
        "hf": str(folder),
        "bom": put("bom.txt", "\ufeffhello world\n"),
        "jsonl_upper": put("chat.JSONL", '{"prompt": "the cat sat"}\n'),
        "long_text": put("long_text.txt", "a " * 4097 + "\n"),
        "empty_gguf": put("empty.gguf", b""),
        "garbage_gguf": put("garbage.GGUF", b"\x00\x01garbage" * 50),
        "truncated_gguf": put("trunc.gguf", gguf.read_bytes()[:4000]),
        "tiny_gguf": str(gguf),
        "notes": put("notes.txt", "not a model\n"),
        "hf_empty": _hf_copy(root / "hf_empty", folder, b""),
        "hf_garbage": _hf_copy(root / "hf_garbage", folder, b"\xff" * 64),
        "hf_truncated": _hf_copy(root / "hf_truncated", folder, weights[: len(weights) // 3]),
        "hf_bad_config": _bad_config_copy(root / "hf_bad_config", folder),
        "dir": str(root),
        "missing": str(root / "missing.txt"),
    }


def _add_word_tokenizer(folder) -> None:
    """A word-level tokenizer (no special tokens added) so text prompts run without a real model's files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{word: i for i, word in enumerate("hello world the cat sat on a mat".split(), 1)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = '{"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}'
    (folder / "tokenizer_config.json").write_text(config)


def _bad_config_copy(target, folder) -> str:
    """A folder whose tokenizer files are fine but whose config.json has a string hidden_size."""
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "hidden_size": "64"}))
    return str(target)


def _hf_copy(target, folder, weights: bytes) -> str:
    target.mkdir()
    (target / "config.json").write_text((folder / "config.json").read_text())
    (target / "model.safetensors").write_bytes(weights)
    return str(target)


# (argv with {file} placeholders, exit status, text the error line must name)
CASES = [
    ([], 2, "command"),
    (["run", "--bogus"], 2, "--bogus"),
    (TINY + ["--block-size", "0"], 2, "--block-size"),
    (TINY + ["--block-size", "3"], 2, "--block-size"),
    (TINY + ["--block-size", "x"], 2, "--block-size"),
    (TINY + ["--block-size", "1e9"], 2, "--block-size"),
    (TINY + ["--block-size", "1024"], 2, "--block-size"),
    (["run", "--model", "", "--prompt", "hi"], 2, "--model"),
    (TINY + ["--seed", "-1"], 2, "--seed"),
    (TINY + ["--seed", "99999999999999999999999"], 2, "--seed"),
    (TINY + ["--device", "foo"], 2, "--device"),
    (TINY + ["--device", "mps"], 2, "--device"),
    (SCORE + ["--device", "foo"], 2, "argument --device: 'foo' cannot be used"),
    (SCORE + ["--block-size", "3"], 2, "argument --block-size: '3' must be a power of two"),
    (SCORE + ["--block-size", "1024"], 2, "argument --block-size"),
    (SCORE + ["--model", ""], 2, "argument --model"),
    (TINY + ["--dtype", "int8"], 2, "--dtype"),
    (["score", "--model", "random:tiny", "--pairs", "{ids}", "--dtype", "float64"], 2, "--dtype"),
    (TINY + ["--prompts", "{empty}"], 1, "{empty}"),
    (TINY + ["--prompts", "{blank}"], 1, "{blank}"),
    (TINY + ["--prompts", "{missing}"], 1, "{missing}"),
    (TINY + ["--prompts", "{dir}"], 1, "{dir}"),
    (TINY + ["--prompts", "{latin1}"], 1, "{latin1}"),
    (TINY + ["--prompts", "{bad_jsonl}"], 1, "{bad_jsonl}:2"),
    (TINY + ["--token-ids", "{empty}"], 1, "{empty}"),
    (TINY + ["--token-ids", "{bad_ids}"], 1, "{bad_ids}:2"),
    (TINY + ["--token-ids", "{negative_ids}"], 1, "{negative_ids}:1"),
    (TINY + ["--token-ids", "{big_id}"], 1, "prompt {big_id}:1"),
    (TINY + ["--token-ids", "{too_long}"], 1, "prompt {too_long}:1 has 4097 tokens"),
    (TINY + ["--token-ids", "{ids}", "--token-ids", "{missing}"], 1, "{missing}"),
    (TINY + ["--prompt", "hi"], 1, "prompt --prompt #1"),
    (["run", "--model", "random:nope", "--token-ids", "{ids}"], 1, "random:nope"),
    (["run", "--model", "{missing}", "--token-ids", "{ids}"], 1, "{missing}"),
    (["run", "--model", "{notes}", "--token-ids", "{ids}"], 1, "{notes}"),
    (["run", "--model", "{empty_gguf}", "--token-ids", "{ids}"], 1, "{empty_gguf}"),
    (["run", "--model", "{garbage_gguf}", "--token-ids", "{ids}"], 1, "{garbage_gguf}"),
    (["run", "--model", "{truncated_gguf}", "--token-ids", "{ids}"], 1, "{truncated_gguf}"),
    (["run", "--model", "{hf_empty}", "--token-ids", "{ids}"], 1, "model.safetensors"),
    (["run", "--model", "{hf_garbage}", "--token-ids", "{ids}"], 1, "model.safetensors"),
    (["run", "--model", "{hf_truncated}", "--token-ids", "{ids}"], 1, "model.safetensors"),
    (["run", "--model", "{hf_bad_config}", "--prompt", "hi"], 1, "hidden_size='64'"),
    (["run", "--model", "{tiny_gguf}", "--prompt", "hi"], 1, "prompt --prompt #1"),
    (["run", "--model", "{hf}", "--prompt", "hello", "--prompt", ""], 1, "prompt --prompt #2 is empty (0 tokens)"),
    (["run", "--model", "{hf}", "--prompts", "{long_text}"], 1, "prompt {long_text}:1 has 4097 tokens"),
    (["run", "--model", "{hf}", "--prompt", "hi", "--chat"], 1, "prompt --prompt #1"),
]


def _fill(parts, files):
    return [part.format(**files) for part in parts]


def _run(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


@pytest.mark.parametrize("argv, status, named", CASES, ids=[" ".join(c[0][1:]) or "none" for c in CASES])
def test_bad_invocation_prints_one_named_error_line(files, capsys, argv, status, named):
    """No traceback; exactly one stderr line starts with `error:` and it names the argument, file or prompt."""
    code, _, err = _run(_fill(argv, files), capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == status, err
    assert "Traceback" not in err and len(errors) == 1, err
    assert named.format(**files) in errors[0], err


def test_llama_gguf_without_tokenizer_runs_token_ids(files, capsys):
    """A GGUF with no tokenizer metadata still runs --token-ids prompts (printed as #ids)."""
    assert main(["run", "--model", files["tiny_gguf"], "--token-ids", files["ids"]]) is None
    out, err = capsys.readouterr()
    assert "error" not in err and "#" in out


def test_repeated_file_flags_are_all_read(files, capsys):
    """Two --token-ids files give one row per line of each, in flag order."""
    main(TINY + ["--token-ids", files["ids"], "--token-ids", files["ids2"]])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("0", "3"), ("1", "4")]


def test_debug_shows_the_traceback(files):
    """--debug lets the original exception through."""
    with pytest.raises(Exception, match="holds no prompts"):
        main(TINY + ["--token-ids", files["empty"], "--debug"])


@pytest.mark.parametrize("name", ["p.jsonl", "p.JSONL", "p.NDJSON", "p.txt"])
def test_json_lines_by_case_insensitive_suffix_or_content(tmp_path, name):
    """A JSON-lines file is read as JSON whatever its suffix's case (or with no such suffix, by its content)."""
    path = tmp_path / name
    path.write_text('{"prompt": "first"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    prompts = read_prompt_file(path)
    assert prompts[0].text == "first" and prompts[1].messages == ({"role": "user", "content": "hi"},)


def test_byte_order_mark_is_stripped(tmp_path):
    """A UTF-8 BOM does not become part of the first prompt."""
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffhello\nworld\n".encode())
    assert [p.text for p in read_prompt_file(path)] == ["hello", "world"]


def test_text_files_repeated_bom_stripped_and_jsonl_by_suffix_case(files, capsys):
    """Two --prompts files are both read; the BOM adds no token; an upper-case .JSONL file is JSON lines."""
    main(["run", "--model", files["hf"], "--prompts", files["bom"], "--prompts", files["jsonl_upper"]])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("0", "2"), ("1", "3")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [TINY, SCORE], ids=["run", "score"])
def test_cuda_on_a_machine_without_it_is_a_usage_error_naming_device(files, capsys, command):
    """score --device cuda without CUDA printed 'unexpected RuntimeError ... report it' and exit 1; now as run."""
    code, _, err = _run(_fill(command + ["--device", "cuda"], files), capsys)
    assert code == 2 and "argument --device: 'cuda' cannot be used" in err, err
