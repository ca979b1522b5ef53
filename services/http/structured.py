"""Structured output of the HTTP API: the request fields that constrain the generated text -> the engine's
``Structure`` (``cdb_engine.config``), which the engine compiles into a grammar.

- OpenAI's ``response_format``: ``{"type": "json_object"}`` (kind ``json_object``), ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``json``), ``{"type": "text"}`` (none);
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (Lark or
  GBNF), ``json_object: true`` (that key's kind; none set: none);
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- a chat's ``tool_choice``: ``"required"`` or a named function (``json``: ``services.http.tools``).

Shapes are checked here, each error naming the field's path as sent (``response_format.json_schema.schema``,
``structured_outputs.regex``, ``guided_choice``): a schema is a JSON object or boolean, or the JSON text of one; a
choice a non-empty list of strings; a regex or a grammar a non-empty string. ``Structure.field`` is that path too,
so that a schema, regex or grammar the engine cannot compile is refused under it. A request takes one structured
output at most: a second is refused naming it (the later in this list's order). vLLM's backend choice
(``guided_decoding_backend``, ``structured_outputs.backend``) may only name this server's: ``auto`` or
``guidance`` (llguidance).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from cdb_engine.config import Structure, StructureKind
from cdb_engine.errors import InvalidRequest
from cdb_engine.validation import schema_spec

BACKENDS = ("auto", "guidance")  # vLLM's backend names this server answers to (llguidance is vLLM's "guidance")
GUIDED = {
    "guided_json": StructureKind.JSON,
    "guided_regex": StructureKind.REGEX,
    "guided_choice": StructureKind.CHOICE,
    "guided_grammar": StructureKind.GRAMMAR,
}
_KEYS = {  # structured_outputs' constraint keys
    "json": StructureKind.JSON,
    "regex": StructureKind.REGEX,
    "choice": StructureKind.CHOICE,
    "grammar": StructureKind.GRAMMAR,
    "json_object": StructureKind.JSON_OBJECT,
}
# structured_outputs' other keys: the values that ask for nothing more than the constraint itself
_OPTIONS: Mapping[str, tuple[tuple[Any, ...], str]] = {
    "backend": (BACKENDS, "only 'auto' or 'guidance' (llguidance, this server's)"),
    "disable_fallback": ((False, True), ""),  # one backend: nothing to fall back to either way
    "disable_any_whitespace": ((False,), "not supported: JSON whitespace is the grammar's default"),
    "disable_additional_properties": ((False,), "not supported: set additionalProperties in the schema"),
    "whitespace_pattern": ((), "not supported"),
    "structural_tag": ((), "structural tags are not supported"),
}


def choice_spec(value: Any, field: str) -> str:
    """The JSON array of a non-empty list of strings."""
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise InvalidRequest(field, "must be a non-empty list of strings")
    return json.dumps(value, ensure_ascii=False)


def _text(what: str) -> Callable[[Any, str], str]:
    def spec(value: Any, field: str) -> str:
        if not isinstance(value, str) or not value:
            raise InvalidRequest(field, f"must be a non-empty string ({what})")
        return value

    return spec


_SPEC: Mapping[StructureKind, Callable[[Any, str], str]] = {
    StructureKind.JSON: schema_spec,
    StructureKind.REGEX: _text("a regular expression the whole output matches"),
    StructureKind.CHOICE: choice_spec,
    StructureKind.GRAMMAR: _text("a Lark or GBNF grammar"),
}


def structure(kind: StructureKind, value: Any, field: str) -> Structure:
    """The ``Structure`` of ``value`` given in ``field`` for ``kind`` (its shape checked)."""
    if kind is StructureKind.JSON_OBJECT:
        return Structure(kind, "", field)
    return Structure(kind, _SPEC[kind](value, field), field)


def response_format(value: Mapping[str, Any] | None) -> Structure | None:
    """OpenAI's ``response_format``: None for ``{"type": "text"}``."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return structure(StructureKind.JSON_OBJECT, None, "response_format")
    if kind != "json_schema":
        raise InvalidRequest("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("response_format.json_schema", "must be an object: {name, schema, strict}")
    if not isinstance(spec.get("name", ""), str):
        raise InvalidRequest("response_format.json_schema.name", "must be a string")
    if not isinstance(spec.get("strict", False), bool | None):
        raise InvalidRequest("response_format.json_schema.strict", "must be a boolean (the output always follows)")
    if spec.get("schema") is None:
        raise InvalidRequest("response_format.json_schema.schema", "is required: the JSON schema of the output")
    return structure(StructureKind.JSON, spec["schema"], "response_format.json_schema.schema")


def structured_outputs(value: Any) -> Structure | None:
    """vLLM's ``structured_outputs``: None when it sets no constraint key (or only ``json_object: false``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs", "must be an object with one of " + ", ".join(_KEYS))
    found: Structure | None = None
    for key, given in value.items():
        field = f"structured_outputs.{key}"
        if key in _OPTIONS:
            neutral, why = _OPTIONS[key]
            if given is not None and not any(given == v and type(given) is type(v) for v in neutral):
                raise InvalidRequest(field, why)
            continue
        if key not in _KEYS:
            raise InvalidRequest(field, "unknown key: one of " + ", ".join(_KEYS) + " constrains the output")
        if key == "json_object" and not isinstance(given, bool | None):
            raise InvalidRequest(field, "must be a boolean")
        if given is None or given is False:
            continue
        if found is not None:
            raise InvalidRequest(field, f"one structured output per request: {found.field} is set already")
        found = structure(_KEYS[key], given, field)
    return found


def one_of(candidates: list[tuple[str, Callable[[], Structure | None]]]) -> Structure | None:
    """The one structure that ``candidates`` (each a top-level field's name and how to read it) ask for, or None;
    ``InvalidRequest`` naming the second field that asks for one."""
    found: tuple[str, Structure] | None = None
    for name, read in candidates:
        got = read()
        if got is None:
            continue
        if found is not None:
            raise InvalidRequest(name, f"one structured output per request: {found[0]} is set already")
        found = (name, got)
    return found[1] if found else None


def request_structure(body: Any) -> list[tuple[str, Callable[[], Structure | None]]]:
    """The structured-output fields of a completion or chat body (``schemas._Common``), in their order of
    precedence, as ``one_of`` takes them."""

    def guided(name: str) -> Callable[[], Structure | None]:
        value = getattr(body, name)
        return lambda: None if value is None else structure(GUIDED[name], value, name)

    return [
        ("response_format", lambda: response_format(body.response_format)),
        ("structured_outputs", lambda: structured_outputs(body.structured_outputs)),
        *((name, guided(name)) for name in GUIDED),
    ]
