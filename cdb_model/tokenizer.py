"""Tokenizers: the ``Tokenizer`` protocol, a built-in byte-level tokenizer and the Hugging Face one.

``HFTokenizer`` serves a checkpoint folder's own tokenizer files. With a ``tokenizer_config.json`` it is
``transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)``: the special tokens, the encoding
and the chat template are exactly what ``transformers`` makes of them. Decoding — the hot path of streaming, two
short decodes per generated token — goes straight to the fast backend (``tokenizers``), which is what
``transformers`` itself does when no clean-up of tokenization spaces is configured. A folder with only
``tokenizer.json`` is served by ``tokenizers`` alone (no chat template).

A caller's bad input (a chat without a template, malformed messages) raises the request error installed with
``use_request_error``: the engine installs its ``InvalidRequest`` (so one exception type reaches the services'
error map); without it, ``TokenizerInputError``. Both name the field and say what is wrong.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cdb_model.config import CheckpointError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (as in Ouro's vocabulary)
BYTE_OFFSET = len(SPECIAL_TOKENS)
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"


class TokenizerInputError(ValueError):
    """A caller's input the tokenizer cannot handle; ``field`` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class TokenizerLoadError(CheckpointError):
    """The folder's tokenizer files cannot be loaded."""


RequestError = Callable[[str, str], Exception]
_request_error: RequestError = TokenizerInputError


def use_request_error(factory: RequestError) -> None:
    """Tokenizers raise ``factory(field, message)`` for a caller's bad input from now on."""
    global _request_error
    _request_error = factory


def request_error(field: str, message: str) -> Exception:
    """The installed request error for ``field``."""
    return _request_error(field, message)


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat (``[{"role": ..., "content": ...}, ...]``) rendered by the model's chat template
        (``chat_template``: this Jinja template instead; ``template_kwargs``: more variables of its context), ending
        with the assistant's turn opened when ``add_generation_prompt``. Raises the request error
        (``InvalidRequest("messages", ...)`` in the engine) when there is no chat template or the messages are
        malformed."""
        ...


def render_chat_template(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    special: Mapping[str, str],
    extra: Mapping[str, Any] | None = None,
) -> str:
    """The text of a chat rendered by a Jinja ``template`` as ``transformers`` renders chat templates (a sandbox,
    ``trim_blocks`` / ``lstrip_blocks``, ``raise_exception``), with ``special`` (``bos_token``, ``eos_token``) in
    its context; for tokenizers that ``transformers`` does not render for. The request error when the template
    refuses the messages."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        context = {**(extra or {}), "messages": messages, "add_generation_prompt": add_generation_prompt, **special}
        return env.from_string(template).render(context)
    except TemplateError as e:
        raise request_error("messages", f"the chat template refused them: {e}") from None


def check_messages(messages: object) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content", ...}`` string dicts, or the request error naming the first
    bad one."""
    if not isinstance(messages, list) or not messages:
        raise request_error("messages", "must be a non-empty list of {role, content} messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise request_error("messages", f"message {i} must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise request_error("messages", f"message {i} needs a string {key!r}")
        if not m["role"]:
            raise request_error("messages", f"message {i} has an empty role")
        out.append(dict(m))
    return out


_BYTE_PIECES = [b""] * BYTE_OFFSET + [bytes([b]) for b in range(256)]  # the byte tokenizer's ids as bytes
_PIECES = [t.encode() for t in SPECIAL_TOKENS] + _BYTE_PIECES[BYTE_OFFSET:]  # with the special tokens' text


class ByteTokenizer:
    """Byte-level tokenizer: ids 0/1/2 = ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; byte b -> id b + 3.

    Special-token strings in the text encode to their ids. Ids >= 259 (possible with a larger model vocabulary)
    decode to "". Stop ids: 0 and 2; EOS: 0. No chat template (presets and folders without tokenizer files).
    """

    _special = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    def __init__(self, vocab_size: int = 512, stop_token_ids: tuple[int, ...] = (0, 2)) -> None:
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"the byte tokenizer needs a vocabulary of >= {BYTE_OFFSET + 256}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.eos_token_id: int | None = 0

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._special.split(text):
            if part in SPECIAL_TOKENS:
                ids.append(SPECIAL_TOKENS.index(part))
            else:
                ids.extend(b + BYTE_OFFSET for b in part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        table = _BYTE_PIECES if skip_special_tokens else _PIECES  # id -> its bytes; other ids decode to nothing
        n = len(table)
        return b"".join([table[i] if 0 <= i < n else b"" for i in ids]).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        checked = check_messages(messages)
        if chat_template is None:
            raise request_error(
                "messages",
                "the served model has no chat template (the byte tokenizer; its folder has no tokenizer files)",
            )
        special = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[0]}
        return self.encode(
            render_chat_template(chat_template, checked, add_generation_prompt, special, template_kwargs)
        )


class HFTokenizer:
    """A checkpoint's own tokenizer: ``path`` is the folder (``tokenizer_config.json``: through
    ``transformers.AutoTokenizer``, never the network) or a ``tokenizer.json`` file (``tokenizers`` only)."""

    def __init__(self, path: str | Path, stop_token_ids: tuple[int, ...] = (), vocab_size: int | None = None):
        from tokenizers import Tokenizer as _Backend

        path = Path(path)
        self._hf: Any = None
        if path.is_dir() and (path / TOKENIZER_CONFIG).is_file():
            self._hf = _auto_tokenizer(path)
            # transformers resets the backend's truncation / padding on the first encode (a mutable borrow of the
            # Rust tokenizer); doing it here keeps later encodes (request threads) and decodes (engine thread)
            # read-only, so they never race on it.
            self._hf.encode("")
            backend = getattr(self._hf, "backend_tokenizer", None)
            # Decoding through the backend equals transformers' own decode unless it cleans up spaces after it.
            self._backend: Any = backend if not self._hf.clean_up_tokenization_spaces else None
            size = len(self._hf)
            eos = self._hf.eos_token_id
        else:
            file = path / TOKENIZER_JSON if path.is_dir() else path
            try:
                self._backend = _Backend.from_file(str(file))
            except Exception as e:  # tokenizers raises a bare Exception for a missing or malformed file
                raise TokenizerLoadError(f"cannot load {file}: {e}") from e
            size = self._backend.get_vocab_size(with_added_tokens=True)
            eos = None
        self.name = str(path)
        self.vocab_size = vocab_size or size
        self.stop_token_ids = stop_token_ids
        self.eos_token_id: int | None = eos if eos is not None else (stop_token_ids[0] if stop_token_ids else None)

    def backend_json(self) -> str:
        """The fast backend's whole definition (``tokenizer.json``'s form, without padding or truncation): what a
        grammar library reads the vocabulary's bytes from."""
        backend = copy.copy(self._backend if self._backend is not None else self._hf.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return str(backend.to_str())

    @property
    def chat_template(self) -> str | None:
        """The chat template (Jinja), None when the tokenizer has none."""
        template = getattr(self._hf, "chat_template", None) if self._hf is not None else None
        return template if isinstance(template, str) and template else None

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special tokens are added as the tokenizer's own configuration says."""
        if self._hf is not None:
            return list(self._hf.encode(text))
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        checked = check_messages(messages)
        if chat_template is None and self.chat_template is None:
            raise request_error("messages", f"the tokenizer of {self.name} has no chat template")
        if self._hf is None:  # a tokenizer.json alone: rendered here, the specials' text as they decode
            assert chat_template is not None
            eos = self.decode([self.eos_token_id], False) if self.eos_token_id is not None else ""
            special = {"bos_token": "", "eos_token": eos}
            return self.encode(
                render_chat_template(chat_template, checked, add_generation_prompt, special, template_kwargs)
            )
        from jinja2 import TemplateError

        try:
            ids = self._hf.apply_chat_template(
                checked,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                chat_template=chat_template,
                **(template_kwargs or {}),
            )
        except TemplateError as e:  # the template's own raise_exception(...) or a template bug
            raise request_error("messages", f"the chat template refused them: {e}") from None
        return [int(i) for i in ids]


def _auto_tokenizer(folder: Path) -> Any:
    """``AutoTokenizer.from_pretrained(folder, local_files_only=True)``. The model's ``config.json`` is this
    project's to parse (transformers knows neither ``ouro`` nor ``huginn_raven``), so an empty config is passed
    in its place: the class comes from ``tokenizer_config.json`` alone, and no remote code ever runs."""
    from transformers import AutoTokenizer, PreTrainedConfig

    try:
        return AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False, config=PreTrainedConfig()
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TokenizerLoadError(f"cannot load the tokenizer of {str(folder)!r}: {e}") from e
