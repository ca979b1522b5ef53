"""Prompts from a data set file (``--dataset-path``), beside the length fits of ``lengths``.

Two kinds of record, in a JSON list or one per line (JSONL), told apart by their keys:

- ShareGPT: ``{"conversations": [{"from": "human", "value": PROMPT}, {"from": "gpt", "value": ANSWER}, ...]}``.
  As ``vllm bench serve`` reads it: the first turn is the prompt, the second the reference answer, and the request
  asks for as many tokens as the answer has (``--output-len`` overrides); records with fewer than two turns are
  skipped, and so are prompts or answers under 4 tokens, prompts over 1024 and prompt + answer over 2048 (and over
  the model's limits when they are known). The records are shuffled with the seed before they are taken.
- Prompts: ``{"prompt": TEXT or [token ids], "output_len": N}`` (or ``"max_tokens"``; ``--output-len`` serves
  records without either). Taken in the file's order, none skipped: the file says what to send.

When the file holds fewer usable records than ``--requests``, they are taken again from the start (so a rate is
still measured over ``--requests`` arrivals); ``distinct`` in the workload says how many there were. Counting
tokens needs a tokenizer (``--tokenizer``): without one, a ShareGPT file needs ``--output-len`` and the prompts'
tokens are the server's count.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdb_model.tokenizer import Tokenizer

MIN_TOKENS = 4  # vLLM's floor on a ShareGPT prompt and reference answer
MAX_PROMPT = 1024  # and its ceilings
MAX_TOTAL = 2048


class DatasetError(ValueError):
    """A data set file that cannot be read, with the place and reason."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's prompt (text or token ids), its tokens (0: not counted here) and how many tokens to ask for."""

    prompt: str | tuple[int, ...]
    prompt_tokens: int
    output_tokens: int

    def as_tuple(self) -> tuple[tuple[int, ...] | str, int, int]:
        return self.prompt, self.prompt_tokens, self.output_tokens


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The file's records: a JSON list, or one JSON object per line."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON: {e}") from None
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{n}: not valid JSON: {e}") from None
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DatasetError(f"{path}: record {bad + 1} is not a JSON object")
    return records


def _sharegpt(
    record: dict[str, Any], tok: Tokenizer | None, output_len: int | None, max_input: int, max_total: int
) -> Prompt | None:
    turns = record["conversations"]
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    prompt, answer = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
    if not isinstance(prompt, str) or not isinstance(answer, str):
        return None
    p = len(tok.encode(prompt)) if tok is not None else 0
    if output_len is None:
        assert tok is not None  # load_prompts asks for one
        out = len(tok.encode(answer))
        if out < MIN_TOKENS:
            return None
    else:
        out = output_len
    if tok is not None and (p < MIN_TOKENS or p > max_input or p + out > max_total):
        return None
    return Prompt(prompt, p, out)


def _prompt(record: dict[str, Any], where: str, tok: Tokenizer | None, output_len: int | None) -> Prompt:
    prompt = record["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = tuple(prompt)
        tokens = len(ids)
    elif isinstance(prompt, str) and prompt:
        ids, tokens = (), len(tok.encode(prompt)) if tok is not None else 0
    else:
        raise DatasetError(f"{where}: 'prompt' must be a non-empty string or list of token ids")
    out = output_len if output_len is not None else record.get("output_len", record.get("max_tokens"))
    if not isinstance(out, int) or isinstance(out, bool) or out < 1:
        raise DatasetError(f"{where}: needs 'output_len' (or 'max_tokens'), a positive integer, or --output-len")
    return Prompt(ids or prompt, tokens, out)


def load_prompts(
    path: str | Path,
    n: int,
    *,
    tokenizer: Tokenizer | None,
    output_len: int | None = None,
    max_input: int = MAX_PROMPT,
    max_total: int = MAX_TOTAL,
    seed: int = 0,
) -> tuple[list[Prompt], int]:
    """``n`` prompts from the file and the number of distinct usable records they came from."""
    records = read_records(path)
    if any("conversations" in r for r in records):
        if tokenizer is None and output_len is None:
            raise DatasetError(
                f"{path}: ShareGPT output lengths are the reference answers' tokens: pass --tokenizer (or --output-len)"
            )
        random.Random(seed).shuffle(records)
    max_input, max_total = min(max_input, MAX_PROMPT), min(max_total, MAX_TOTAL)
    usable: list[Prompt] = []
    for i, record in enumerate(records):
        where = f"{path}: record {i + 1}"
        if "conversations" in record:
            p = _sharegpt(record, tokenizer, output_len, max_input, max_total)
        elif "prompt" in record:
            p = _prompt(record, where, tokenizer, output_len)
        else:
            raise DatasetError(f"{where}: neither 'conversations' (ShareGPT) nor 'prompt'")
        if p is not None:
            usable.append(p)
        if len(usable) == n:
            break
    if not usable:
        raise DatasetError(
            f"{path}: no usable record (ShareGPT: two turns, prompt and answer of {MIN_TOKENS} tokens or more, "
            f"prompt <= {max_input} and prompt + answer <= {max_total} tokens)"
        )
    return [usable[i % len(usable)] for i in range(n)], len(usable)


def describe_prompts(prompts: Sequence[Prompt], distinct: int, path: str) -> dict[str, Any]:
    """The ``workload`` part of a result for a data set file."""
    n = len(prompts)
    return {
        "dataset": "file",
        "dataset_path": path,
        "requests": n,
        "distinct": distinct,
        "mean_prompt_tokens": sum(p.prompt_tokens for p in prompts) / n,  # 0 where not counted here
        "mean_output_tokens": sum(p.output_tokens for p in prompts) / n,
    }
