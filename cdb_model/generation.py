"""A checkpoint's ``generation_config.json``: its end-of-sequence ids and its sampling defaults.

Hugging Face ``generate`` stops at ``generation_config.eos_token_id`` (an id or a list of ids) and samples with
its ``temperature`` / ``top_p`` / ``top_k`` only when ``do_sample`` is true (otherwise it decodes greedily).
``GenerationDefaults`` keeps exactly those fields; ``sampling`` applies them to the values a caller left unset.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdb_model.config import CheckpointError

GENERATION_CONFIG = "generation_config.json"
HF_DEFAULT_TOP_K = 50  # transformers' GenerationConfig default when do_sample and no top_k


class GenerationConfigError(CheckpointError):
    """``generation_config.json`` is unreadable or holds a field of the wrong type."""


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What ``generation_config.json`` says about stopping and sampling (None: the file does not say)."""

    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None

    def sampling(
        self, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None
    ) -> tuple[float, float, int]:
        """(temperature, top_p, top_k) for a request: the caller's value where given, else the checkpoint's, as
        ``transformers`` would sample: with ``do_sample``, its values or transformers' own defaults (temperature 1,
        top_p 1, top_k 50); without it, greedy (temperature 0, no filters)."""
        if self.do_sample:
            dt, dp, dk = (
                1.0 if self.temperature is None else self.temperature,
                1.0 if self.top_p is None else self.top_p,
                HF_DEFAULT_TOP_K if self.top_k is None else self.top_k,
            )
        else:
            dt, dp, dk = 0.0, 1.0, 0
        return (
            dt if temperature is None else temperature,
            dp if top_p is None else top_p,
            dk if top_k is None else top_k,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = GENERATION_CONFIG) -> GenerationDefaults:
        """Parse the fields this project uses; a wrong type raises ``GenerationConfigError`` naming the field."""

        def number(name: str, lo: float, hi: float) -> float | None:
            v = d.get(name)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
                raise GenerationConfigError(f"{where}: {name} must be a number in [{lo}, {hi}], got {v!r}")
            return float(v)

        def count(name: str) -> int | None:
            v = d.get(name)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise GenerationConfigError(f"{where}: {name} must be an integer >= 0, got {v!r}")
            return v

        eos = d.get("eos_token_id")
        ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise GenerationConfigError(f"{where}: eos_token_id must be a token id or a list of them, got {eos!r}")
        top_p = number("top_p", 0.0, 1.0)
        if top_p == 0.0:
            raise GenerationConfigError(f"{where}: top_p must be in (0, 1], got 0")
        return cls(
            eos_token_ids=tuple(dict.fromkeys(ids)),
            do_sample=bool(d.get("do_sample", False)),
            temperature=number("temperature", 0.0, math.inf),
            top_p=top_p,
            top_k=count("top_k"),
            max_new_tokens=count("max_new_tokens"),
        )


def read_generation_defaults(folder: Path) -> GenerationDefaults:
    """``folder / generation_config.json`` parsed; an absent file gives the empty defaults."""
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        return GenerationDefaults()
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(d, dict):
        raise GenerationConfigError(f"{path} must hold a JSON object")
    return GenerationDefaults.from_dict(d, str(path))
