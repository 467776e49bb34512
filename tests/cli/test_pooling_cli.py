"""``python -m prefill_shell embed`` / ``rerank``: a file embedded in one command equals sentence-transformers'
``encode`` of its texts (.npy and .jsonl, text and JSON-lines input); a query's documents ranked as
``CrossEncoder.rank`` ranks them; bad input named in one error line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from prefill_shell.cli.main import main
from tests.e2e.pooling_kit import seq_cls_folder, st_folder, texts
from tests.family_kit import relative_error

pytest.importorskip("sentence_transformers")


def test_embed_a_file_to_npy_and_jsonl(tmp_path, capsys):
    from sentence_transformers import SentenceTransformer

    folder = st_folder("qwen3", tmp_path / "st", "mean", normalize=True)
    rows = texts(2, [3, 90, 20, 150])
    (tmp_path / "in.txt").write_text("\n".join(rows) + "\n\n")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(rows)))
    expected = SentenceTransformer(str(folder), device="cpu").encode(rows, convert_to_tensor=True)
    common = ["--model", str(folder), "--block-size", "16", "--max-chunk", "64"]
    main(["embed", "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.npy"), *common])
    ours = torch.from_numpy(np.load(tmp_path / "out.npy"))
    assert ours.shape == (4, 64) and max(relative_error(a, b) for a, b in zip(ours, expected)) <= 1e-5
    main(["embed", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), *common])
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    assert max(relative_error(torch.tensor(line["embedding"]), e) for line, e in zip(lines, expected)) <= 1e-5
    err = capsys.readouterr().err
    assert "embed 4/4" in err and "[embed] 4 texts" in err  # progress and the summary on stderr


def test_rerank_prints_documents_best_first(tmp_path, capsys):
    from sentence_transformers import CrossEncoder

    folder = seq_cls_folder("mistral", tmp_path / "ce", num_labels=1)
    query, *documents = texts(4, [50, 4, 70, 9, 33])
    (tmp_path / "docs.txt").write_text("\n".join(documents))
    ranked = CrossEncoder(str(folder), device="cpu").rank(query, documents)
    main(["rerank", "--model", str(folder), "--query", query, "--documents", str(tmp_path / "docs.txt"), "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [r["corpus_id"] for r in ranked]
    assert all(abs(line["score"] - float(r["score"])) <= 1e-5 for line, r in zip(lines, ranked))


def test_bad_input_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"text": "w1"}) + "\n" + json.dumps({"body": "w2"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["embed", "--model", str(tmp_path), "--input", str(path), "--output", str(tmp_path / "o.npy")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "in.jsonl:2" in err and "'text'" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        main(["embed", "--model", str(tmp_path), "--input", str(path), "--output", str(tmp_path / "o.csv")])
    assert exit_info.value.code == 1 and "name a .npy or .jsonl file" in capsys.readouterr().err
