"""``cdb bench structured``'s workload: the schema, the prompts' source, the requests of each mode, validity."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema

from cdb_engine.config import EngineConfig, RequestParams, Structure, StructureKind
from cdb_engine.engine import StageSetup
from cdb_engine.inprocess import shared_model_factory
from cdb_engine.setup import torch_dtype
from cdb_model.loader import DEFAULT_MODEL, load_model, resolve_source
from cdb_scheduler.plan import Executor
from cdb_scheduler.sampling import SamplingParams

MODES = ("skip_on", "skip_off", "unconstrained")
CPU_OP_US, CPU_WIDTH = 500.0, 64
CPU_KEY = "ratio_constrained_over_unconstrained"
MASKS_KEY = "ratio_masks_only_over_unconstrained"  # constrained without forced skips: what the masks alone cost
QUICK = {"requests": 6, "rounds": 2, "seconds": 1.0, "warmup": 0.5}


def _text(max_length: int, pattern: str) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, "pattern": pattern}


# An object of typed fields: bounded strings (letters: a byte-level tokenizer's tokens stay one a character),
# a bounded integer, an enum, an array of bounded length, a nested object. Longest compact instance: 123 bytes.
_PLACE = {"name": _text(8, "^[A-Za-z]*$"), "holy": {"type": "boolean"}}
_FIELDS = {
    "book": _text(8, "^[A-Za-z ]+$") | {"minLength": 1},
    "chapter": {"type": "integer", "minimum": 1, "maximum": 150},
    "speaker": {"enum": ["god", "moses", "noah", "the lord", "prophet"]},
    "words": {"type": "array", "items": _text(6, "^[a-z]*$"), "minItems": 1, "maxItems": 2},
    "place": {"type": "object", "properties": _PLACE, "required": list(_PLACE), "additionalProperties": False},
}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": _FIELDS,
    "required": list(_FIELDS),
    "additionalProperties": False,
}
STRUCTURE = Structure(StructureKind.JSON, json.dumps(SCHEMA))


def clauses(count: int) -> list[str]:
    """``count`` short texts: the clauses of the shipped model's held-out sample, in order, repeated as needed."""
    text = (Path(resolve_source(DEFAULT_MODEL)) / "heldout_sample.txt").read_text()
    parts = [p.strip(" ,.") for p in re.split(r"[;:\n]|, (?=and |that |which |until |for )", text)]
    unique = list(dict.fromkeys(p for p in parts if len(p.split()) >= 4))
    return [unique[i % len(unique)] for i in range(count)]


def valid(text: str) -> bool:
    """Whether ``text`` is JSON valid against ``SCHEMA``."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def executor_factory(cfg: EngineConfig) -> Callable[[StageSetup], Executor] | None:
    """The model's in-process stages, weights loaded once and shared (None: synthetic ones, the engine's own)."""
    if cfg.synthetic_cost:
        return None
    return shared_model_factory(load_model(cfg.model, dtype=torch_dtype(cfg.dtype), device=cfg.device))


def request(max_tokens: int, seed: int, structure: Structure | None = STRUCTURE) -> RequestParams:
    """A request of the workload: sampled at temperature 1 with its own seed."""
    return RequestParams(
        max_tokens=max_tokens, sampling=SamplingParams(temperature=1.0, seed=seed), structure=structure
    )


def mode_params(mode: str, count: int, max_tokens: int, seed: int) -> list[RequestParams]:
    structure = None if mode == "unconstrained" else STRUCTURE
    return [request(max_tokens, seed + i, structure) for i in range(count)]
