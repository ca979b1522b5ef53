"""The chat template of the HTTP API: the tokenizer's own, or the one the server was given (``--chat-template``,
``CDB_CHAT_TEMPLATE``: a Jinja file's path or the template itself), which overrides it.

The override renders ``/v1/chat/completions`` and ``/tokenize``'s ``messages`` (a chat's ``tools`` are the
template's ``tools``), and ``/tokenizer_info`` reports it as the ``chat_template`` (a remote tokenizer renders what
the server renders). It is checked (read and compiled) once, at start: a missing file or a template that does not
compile fails the server at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cdb_engine.errors import InvalidRequest
from cdb_model.tokenizer import Tokenizer

# What the renderer itself passes a template (transformers' and this project's): not a request's to set.
RESERVED = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents", "chat_template",
     "tokenize", "return_dict", "continue_final_message", "raise_exception"}
)  # fmt: skip


class ChatTemplateError(ValueError):
    """The configured chat template cannot be read or does not compile."""


def read_chat_template(value: str) -> str | None:
    """The template ``value`` names: the text of the file at that path, else ``value`` itself when it is a template
    (holds ``{{`` or ``{%``); None for an empty value. ``ChatTemplateError`` otherwise, or when it does not
    compile."""
    if not value:
        return None
    path = Path(value).expanduser()
    looks_inline = "{{" in value or "{%" in value
    if not looks_inline:
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"chat template {str(path)!r}: not a readable file nor a template ({e})") from None
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(value)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template: does not compile (line {e.lineno}: {e.message})") from None
    return value


class ChatTemplate:
    """Renders chats for the API: with ``override`` (a template's text) when given, else the tokenizer's own."""

    def __init__(self, tokenizer: Tokenizer, override: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.override = override

    @property
    def source(self) -> str | None:
        """The template in use (None: none; a chat is then refused naming ``messages``)."""
        return self.override or getattr(self.tokenizer, "chat_template", None)

    def apply(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat (the request error naming ``messages`` for a chat it cannot render);
        ``template_kwargs``: more variables of the template (a request's ``chat_template_kwargs``; none may be
        one the renderer sets: ``InvalidRequest`` naming the field); ``tools``: the request's tools (OpenAI's
        shape), the template's ``tools`` (unset when there are none)."""
        taken = sorted(RESERVED & set(template_kwargs or ()))
        if taken:
            raise InvalidRequest("chat_template_kwargs", f"{', '.join(taken)}: set by the server, not by a request")
        if tools:
            template_kwargs = {**(template_kwargs or {}), "tools": tools}
        return self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.override,
            template_kwargs=template_kwargs,
        )
