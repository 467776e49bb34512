"""The ``prefill_mmlu`` task's prompt (``doc_to_text``) and data (``python evals/prefill_mmlu.py`` writes it).

An MMLU-shaped multiple-choice task: a subject description and five fixed
few-shot examples (``dev``, lm-eval's ``first_n`` sampler) shared by every
one of 100 test documents, single-letter answer choices. Every context
starts with the same ~300 tokens, so its requests form one sharing group far
larger than a scorer's round. The prompt is a function, not a Jinja template:
lm-eval compiles a template once per document and few-shot example.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ("Ada", "Bram", "Chiara", "Dmitri", "Esme", "Farid", "Greta", "Hiro", "Ines", "Jonas")
THINGS = ("marbles", "stamps", "shells", "coins", "pencils", "tickets", "buttons", "cards")


def _document(rng: random.Random) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    first, second = rng.randint(2, 40), rng.randint(2, 40)
    right = first + second
    wrong = rng.sample([v for v in range(max(1, right - 12), right + 13) if v != right], 3)
    choices = [str(v) for v in wrong]
    answer = rng.randrange(4)
    choices.insert(answer, str(right))
    question = f"{name} has {first} {thing} and is given {second} more. How many {thing} does {name} have now?"
    return {"question": question, "choices": choices, "answer": answer}


def doc_to_text(doc: dict) -> str:
    """A document's question, its lettered choices and ``Answer:`` (MMLU's layout)."""
    letters = "\n".join(f"{letter}. {choice}" for letter, choice in zip("ABCD", doc["choices"]))
    return f"{doc['question'].strip()}\n{letters}\nAnswer:"


def main() -> None:
    rng = random.Random(34)
    for split, count in (("dev", 5), ("test", 100)):
        lines = [json.dumps(_document(rng)) for _ in range(count)]
        (HERE / f"prefill_mmlu_{split}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
