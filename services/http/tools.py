"""Chat tool calls: OpenAI's ``tools`` and ``tool_choice`` -> the constraint of the generated text, and that text
-> the response's ``tool_calls``.

There is no tool-call parser here, so a tool call is never the model's free choice: ``tool_choice`` must force
one (``auto`` with tools is refused). The tools reach the chat template (its ``tools`` variable) whatever the
choice.

- omitted or ``"none"`` (or ``"auto"`` without tools): the text is free, the response's ``content``;
- a named function, ``{"type": "function", "function": {"name": N}}``: the text is JSON of tool N's
  ``parameters`` schema; the response is one call of N whose ``arguments`` are the text, ``finish_reason`` ``stop``;
- ``"required"``: the text is a JSON array (one item at least; one at most with ``parallel_tool_calls: false``) of
  ``{"name": one of the tools, "parameters": its schema}``; the response has a call per item, whose ``arguments``
  are its ``parameters`` as JSON, ``finish_reason`` ``tool_calls``.

Either constraint is a ``Structure`` of kind ``json`` whose field is ``tool_choice``; the response's ``content`` is
null. ``finish_reason`` is vLLM's (and OpenAI's): ``stop`` for a named function, ``tool_calls`` for ``required``. A
call's ``id`` is ``call_`` and 24 random hex digits. A stream opens a named call in its first chunk (``index`` 0,
``id``, ``type``, ``function.name``, ``arguments`` ``""``), then sends each token's text as an ``arguments``
fragment; a ``required`` stream sends each call whole once its array item is complete. A generation cut short
(``length``, or a stop string) keeps what there is: a named call with its partial ``arguments``; for ``required``,
the complete items' calls, and the whole text as ``content`` when the array is unfinished.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from cdb_engine.config import Structure, StructureKind
from cdb_engine.errors import InvalidRequest
from services.http.responses import ChatRender

_NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI's meaning of a function without ``parameters``
_AUTO = "'auto' needs a tool-call parser, which this server does not have: use 'required' or a named function"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A forced tool call: of the function ``name``, or (None) of one or more of the tools (``required``), the
    generated text following ``structure``."""

    name: str | None
    structure: Structure


def check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """Each tool's ``parameters`` schema by its name (``InvalidRequest`` naming the first bad tool field)."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise InvalidRequest("tools", "must be a list of {type: function, function: {name, description, parameters}}")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest(f"{at}.type", "only function tools are supported ({type: function, function})")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{at}.function", "must be an object: {name, description, parameters}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{at}.function.name", "must be a non-empty string")
        if name in out:
            raise InvalidRequest(f"{at}.function.name", f"two tools are named {name!r}")
        if not isinstance(function.get("description", ""), str | None):
            raise InvalidRequest(f"{at}.function.description", "must be a string")
        parameters = function.get("parameters")
        if not isinstance(parameters, dict | None):
            raise InvalidRequest(f"{at}.function.parameters", "must be a JSON schema object")
        out[name] = parameters or _NO_PARAMETERS
    return out


def required_schema(tools: dict[str, dict[str, Any]], parallel: bool | None = None) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: required``: an array of ``{"name", "parameters"}`` calls of the tools."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, parameters in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema | ({"maxItems": 1} if parallel is False else {})


def tool_call(tools: Any, tool_choice: Any, parallel: bool | None = None) -> ToolCall | None:
    """The tool call ``tool_choice`` forces with these ``tools`` (None: none, the text is free), or
    ``InvalidRequest`` naming the field."""
    schemas = check_tools(tools)
    if tool_choice is None or tool_choice == "auto":
        if schemas:  # (omitted: OpenAI's default with tools is auto)
            raise InvalidRequest("tools" if tool_choice is None else "tool_choice", _AUTO)
        return None
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        if not schemas:
            raise InvalidRequest("tool_choice", "'required' needs tools")
        spec = json.dumps(required_schema(schemas, parallel), ensure_ascii=False)
        return ToolCall(None, Structure(StructureKind.JSON, spec, "tool_choice"))
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest("tool_choice", "must be 'none', 'auto', 'required' or {type: function, function: {name}}")
    if name not in schemas:
        known = ", ".join(repr(n) for n in schemas) or "none"
        raise InvalidRequest("tool_choice", f"no tool is named {name!r} (tools: {known})")
    return ToolCall(name, Structure(StructureKind.JSON, json.dumps(schemas[name], ensure_ascii=False), "tool_choice"))


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class CallArray:
    """The complete calls (``{"name": str, "parameters": ...}`` items) of a JSON array whose text arrives in
    pieces: ``advance(text so far)`` returns the calls completed since the last time."""

    def __init__(self) -> None:
        self.pos = 0  # where reading resumes
        self.state = "open"  # open: "[" is due; first: an item or "]"; next: "," or "]"; item; closed; bad
        self.tried = 0  # the text's length when the pending item was last found incomplete

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    def advance(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self.state not in ("closed", "bad"):
            i = self.pos
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i == len(text):
                break
            c = text[i]
            if self.state == "open":
                self.state, self.pos = ("first", i + 1) if c == "[" else ("bad", i)
            elif c == "]" and self.state in ("first", "next"):
                self.state, self.pos = "closed", i + 1
            elif self.state == "next":
                self.state, self.pos = ("item", i + 1) if c == "," else ("bad", i)
            else:  # an item begins at i: an object, complete only once a "}" has come
                if "}" not in text[max(i, self.tried) :]:
                    break
                try:
                    item, end = _DECODER.raw_decode(text, i)
                except json.JSONDecodeError:
                    self.tried = len(text)
                    break
                if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "parameters" not in item:
                    self.state = "bad"
                    break
                out.append(item)
                self.state, self.pos = "next", end
        return out


def call_of(item: dict[str, Any]) -> dict[str, Any]:
    """The ``tool_calls`` entry of one item of a ``required`` array."""
    arguments = json.dumps(item["parameters"], ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": item["name"], "arguments": arguments}}


class ToolCallRender(ChatRender):
    """A chat choice whose generated text is a forced tool call (``ToolCall``): the format of the module
    docstring."""

    def __init__(self, *args: Any, tool: ToolCall, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tool = tool
        self.call_id = new_call_id()  # a named call's
        self.array = CallArray() if tool.name is None else None
        self.calls: list[dict[str, Any]] = []  # ``required``: the calls of the array's complete items
        self.sent = 0  # of them streamed

    def _advance(self) -> None:
        """``calls`` as of the text so far (``required``)."""
        assert self.array is not None
        self.calls.extend(call_of(item) for item in self.array.advance(self.text))

    def _sync(self) -> list[dict[str, Any]]:
        """The calls completed by the text so far that were not streamed yet, with their ``index``."""
        self._advance()
        new = [{"index": k, **call} for k, call in enumerate(self.calls[self.sent :], start=self.sent)]
        self.sent = len(self.calls)
        return new

    def finish_reason(self) -> str:
        reason = super().finish_reason()
        if reason != "stop" or self.array is None:
            return reason
        self._advance()
        return "tool_calls" if self.array.closed and self.calls else reason

    def first(self) -> list[dict[str, Any]]:
        choice = self._chunk_choice("", None, None, {"depths": []})
        choice["delta"] = {"role": "assistant", "content": None}
        if self.tool.name is not None:
            opening = {"name": self.tool.name, "arguments": ""}
            choice["delta"]["tool_calls"] = [{"index": 0, "id": self.call_id, "type": "function", "function": opening}]
        return [self._envelope([choice])]

    def _chunk_choice(
        self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, cdb: dict[str, Any]
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.array is None:
            if text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
        else:
            new = self._sync()
            if new:
                delta["tool_calls"] = new
            if finish_reason is not None and not self.array.closed:
                delta["content"] = self.text  # an unfinished array: the whole text, as it is
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, "cdb": cdb}

    def _full_choice(self, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if self.array is None:
            arguments = {"name": self.tool.name, "arguments": self.text}
            message["tool_calls"] = [{"id": self.call_id, "type": "function", "function": arguments}]
        else:
            self._sync()
            if self.calls:
                message["tool_calls"] = list(self.calls)
            if not self.array.closed:
                message["content"] = self.text
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason()}
