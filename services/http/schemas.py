"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into the engine's parameters.

Types are checked here (a wrong type is a 400 naming the field); values are checked by the engine
(``Engine.validate``), whose ``InvalidRequest.field`` names are translated back to this API's field names by
``FIELDS`` / ``CHAT_FIELDS``. Fields OpenAI clients send that the engine cannot honour are refused when set to
anything but their neutral value (``n`` > 1, penalties, ``logit_bias``, tools, ...); unknown extra fields are
ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from cdb_engine.config import RequestParams
from cdb_engine.errors import InvalidRequest
from cdb_model.generation import GenerationDefaults
from cdb_scheduler.plan import SamplingParams

# The engine's field names -> this API's (a value the engine refuses is reported under the name the caller sent).
FIELDS = {"stop_strings": "stop", "stop_token_ids": "stop"}
CHAT_FIELDS = {**FIELDS, "prompt": "messages", "logprobs": "top_logprobs"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class ResumeState(BaseModel):
    """``resume``: what a broken stream had delivered (the ``cdb.token_ids`` and ``cdb.depths`` of its chunks)."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[StrictInt]
    depths: list[StrictInt]


class _Common(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's names and defaults, plus cdb extensions)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None  # OpenAI's default: 1
    top_p: float | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None  # omitted: a fresh random seed per request (OpenAI's behaviour)
    max_tokens: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    # cdb extensions (OpenAI clients pass them with ``extra_body``)
    exit_threshold: float | None = None  # per-request exit threshold of the loop (lower: shallower, faster)
    top_k: StrictInt | None = None
    ignore_eos: StrictBool = False
    resume: ResumeState | None = None  # continue a broken stream after the tokens it had delivered

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        # one clear message instead of pydantic's per-member errors of ``str | list[str]``
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError("must be a string or a list of strings")

    def refuse_unsupported(self) -> None:
        """``InvalidRequest`` naming the first field set to something the engine cannot do."""
        if self.n is not None and self.n != 1:
            raise InvalidRequest("n", f"only n=1 is supported, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequest(name, "penalties are not supported (use 0 or omit it)")
        if self.logit_bias:
            raise InvalidRequest("logit_bias", "not supported (omit it)")

    def sampling(self, logprobs: int | None, defaults: GenerationDefaults | None = None) -> SamplingParams:
        """``logprobs``: None for none, else the number of alternatives (0: only the sampled token's). What the
        request leaves unset comes from the checkpoint's ``generation_config.json`` when it says how to sample
        (``defaults``, as ``transformers`` would: its values with ``do_sample``, else greedy), else from OpenAI's
        defaults (temperature 1, no top-p / top-k filter)."""
        if defaults is not None and says_sampling(defaults):
            temperature, top_p, top_k = defaults.sampling(self.temperature, self.top_p, self.top_k)
        else:
            temperature = 1.0 if self.temperature is None else self.temperature
            top_p, top_k = 1.0 if self.top_p is None else self.top_p, self.top_k or 0
        return SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=secrets.randbits(63) if self.seed is None else self.seed,
            logprobs=logprobs or 0,
            return_logprob=logprobs is not None,
        )

    def params(
        self, max_tokens: int, logprobs: int | None, defaults: GenerationDefaults | None = None
    ) -> RequestParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return RequestParams(
            max_tokens=max_tokens,
            sampling=self.sampling(logprobs, defaults),
            stop_strings=tuple(stop),
            exit_threshold=self.exit_threshold,
            ignore_eos=self.ignore_eos,
            resume_tokens=tuple(self.resume.token_ids) if self.resume else (),
            resume_depths=tuple(self.resume.depths) if self.resume else (),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: Any = Field(description="a string, a list of token ids, or a list holding one of those")
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]  # a batch of one
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
            raise ValueError("one prompt per request (send several requests)")
        raise ValueError("must be a string or a non-empty list of token ids")

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise InvalidRequest("echo", "not supported (omit it)")
        if self.best_of is not None and self.best_of != 1:
            raise InvalidRequest("best_of", f"only best_of=1 is supported, got {self.best_of}")
        if self.suffix:
            raise InvalidRequest("suffix", "not supported (omit it)")
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequest("logprobs", f"must be >= 0, got {self.logprobs}")

    def requested_max_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions

    def to_engine(self, defaults: GenerationDefaults | None = None) -> tuple[str | list[int], RequestParams]:
        self.refuse_unsupported()
        return self.prompt, self.params(self.requested_max_tokens(), self.logprobs, defaults)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Any = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        """A string, None, or a list of text parts (joined); other part types are refused."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported ({'type': 'text', 'text': ...})")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("must be a string or a list of text content parts")


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise InvalidRequest("messages", "must not be empty")
        if self.tools:
            raise InvalidRequest("tools", "tool calls are not supported (omit tools)")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequest("response_format", "only {'type': 'text'} is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise InvalidRequest("top_logprobs", f"must be >= 0, got {self.top_logprobs}")

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (or the deprecated ``max_tokens``); None: up to the context limit."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content or ""} for m in self.messages]

    def to_params(self, max_tokens: int, defaults: GenerationDefaults | None = None) -> RequestParams:
        """The engine's parameters (after ``refuse_unsupported``)."""
        return self.params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults)


def says_sampling(defaults: GenerationDefaults) -> bool:
    """The checkpoint's ``generation_config.json`` says how to sample (not only its end-of-sequence ids)."""
    return defaults.do_sample or any(v is not None for v in (defaults.temperature, defaults.top_p, defaults.top_k))


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` (text, or token ids echoed back), or chat ``messages``
    rendered by the chat template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[StrictInt] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True  # the tokenizer's own configuration decides; accepted for compatibility
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]
