"""Writes the harness tasks' data (``tasks/*.jsonl``) from the shipped model's held-out verses
(``models/ouro-kjv/heldout_sample.txt``, never trained on): ``python -m tests.harness.make_tasks``.

- ``kjv_cloze`` (log-likelihood, multiple choice): a verse's first words; the next word against three other words
  of the sample (seeded draw).
- ``kjv_continue`` (generate-until): a verse's first words; the continuation, generated greedily, scored by chrF
  against the verse's next (up to) eight words. The first generated token comes from the full-depth prefill, the
  next ones are served at the exit threshold's depth.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "models" / "ouro-kjv" / "heldout_sample.txt"
OUT = Path(__file__).resolve().parent / "tasks"
SPLITS = (3, 6, 9, 12)  # a verse is cut after this many words (when a plain word follows)


def docs() -> list[dict[str, str]]:
    out = []
    for verse in SOURCE.read_text().splitlines():
        words = verse.split()
        for k in SPLITS:
            if k < len(words) and words[k].isalpha():
                out.append({"context": " ".join(words[:k]), "word": words[k], "rest": " ".join(words[k : k + 8])})
    return out


def main() -> None:
    rng = random.Random(0)
    all_docs = docs()
    vocab = sorted({d["word"] for d in all_docs})
    with (OUT / "kjv_cloze.jsonl").open("w") as f:
        for d in all_docs:
            others = rng.sample([w for w in vocab if w.lower() != d["word"].lower()], 3)
            choices = [d["word"], *others]
            rng.shuffle(choices)
            cloze = {"context": d["context"], "word": d["word"], "choices": choices, "label": choices.index(d["word"])}
            f.write(json.dumps(cloze) + "\n")
    with (OUT / "kjv_continue.jsonl").open("w") as f:
        for d in all_docs:
            f.write(json.dumps({"context": d["context"], "target": d["rest"]}) + "\n")


if __name__ == "__main__":
    main()
