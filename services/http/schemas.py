"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into the engine's parameters.

Types are checked here (a wrong type is a 400 naming the field); values are checked by the engine
(``Engine.validate``), whose ``InvalidRequest.field`` names are translated back to this API's field names by
``FIELDS`` / ``CHAT_FIELDS``. Fields OpenAI and vLLM clients send that the engine cannot honour are refused when
set to anything but their neutral value (``suffix``, ...: ``services.http.vllm_fields``); keys that are neither
OpenAI's nor vLLM's are ignored, as OpenAI-compatible servers do. Structured output and forced tool calls are
``services.http.structured`` and ``services.http.tools``.

One body may ask for several choices: a completion's list of prompts, and ``n`` samples of each. Each choice is
its own engine request (``choices()``: prompt ``i``'s sample ``j`` is choice ``i * n + j``); sample ``j`` draws
with the seed ``sample_seed(seed, j)``, so every choice is reproducible alone and whatever else is batched.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from cdb_engine.config import RequestParams, Structure, logits_processing
from cdb_engine.errors import InvalidRequest
from cdb_model.generation import GenerationDefaults
from cdb_scheduler.plan import derive_seed
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams
from services.http.structured import one_of, request_structure
from services.http.tools import ToolCall, tool_call
from services.http.vllm_fields import refuse_unhonoured

# The engine's field names -> this API's (a value the engine refuses is reported under the name the caller sent).
FIELDS = {"stop_strings": "stop"}
CHAT_FIELDS = {**FIELDS, "prompt": "messages", "logprobs": "top_logprobs"}

MAX_CHOICES = 256  # choices of one body (prompts x n): each is an engine request, in the caller's share


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample ``sample`` of a prompt (``n`` > 1): the request's own for sample 0 (an ``n`` = 1 request
    with that seed gives the same choice), else ``derive_seed(seed, sample)`` (splitmix64, independent)."""
    return seed if sample == 0 else derive_seed(seed, sample)


def _is_ids(v: Any) -> bool:
    """A non-empty list of token ids."""
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: the usage so far in every chunk


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
    min_p: float | None = None  # vLLM's extension: drop tokens less likely than min_p x the most likely one
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None  # omitted: a fresh random seed per request (OpenAI's behaviour)
    max_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None  # vLLM's extension: ids that end the generation (included)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    repetition_penalty: float | None = None  # vLLM's extension: > 1 discourages tokens of the prompt and output
    min_tokens: StrictInt | None = None  # vLLM's extension: no stop id before this many tokens
    user: str | None = None  # accepted and ignored
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema: one structure at most, of these
    structured_outputs: Any = None  # vLLM's: {json | regex | choice | grammar | json_object}
    guided_json: Any = None  # vLLM's older fields
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's extensions
    include_stop_str_in_output: StrictBool = False  # the text ends with the stop string it hit
    skip_special_tokens: StrictBool = True  # false: special tokens' text is part of the output
    request_id: str | None = None  # the request's id (as the X-Request-Id header), in the response's id and logs
    cache_salt: str | None = None  # prefix caching: only requests of the same salt share cached KV
    prompt_logprobs: StrictInt | None = None  # each prompt token's logprob and this many alternatives (full depth)
    priority: StrictInt = 0  # lower first: the waiting queue's order, and preempted last
    # cdb extensions (OpenAI clients pass them with ``extra_body``)
    exit_threshold: float | None = None  # per-request exit threshold of the loop (lower: shallower, faster)
    speculative: StrictBool | None = None  # self-speculative decoding for this request (None: the server's choice)
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
        refuse_unhonoured(self.model_extra)
        if self.prompt_logprobs is not None:
            asked = self.output_logprobs()
            if self.prompt_logprobs < 0:
                raise InvalidRequest("prompt_logprobs", f"must be >= 0, got {self.prompt_logprobs}")
            if asked is not None and asked != self.prompt_logprobs:
                raise InvalidRequest(
                    "prompt_logprobs", f"must equal the output's alternatives ({asked}) when both are asked for"
                )

    def structure(self) -> Structure | None:
        """The structured output the request asks for (``InvalidRequest`` naming a malformed or second one)."""
        return one_of(request_structure(self))

    def output_logprobs(self) -> int | None:
        """The alternatives asked for each output token (None: no logprobs)."""
        return None

    def processing(self) -> LogitsProcessing | None:
        """Penalties, logit bias and min_tokens (checked by the engine); ``logit_bias`` keys must be token ids."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidRequest("logit_bias", f"keys must be token ids, got {key!r}") from None
        return logits_processing(
            self.presence_penalty or 0.0,
            self.frequency_penalty or 0.0,
            1.0 if self.repetition_penalty is None else self.repetition_penalty,
            bias,
            self.min_tokens or 0,
        )

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
            min_p=self.min_p or 0.0,
            seed=secrets.randbits(63) if self.seed is None else self.seed,
            logprobs=logprobs or 0,
            return_logprob=logprobs is not None,
            processing=self.processing(),
        )

    @property
    def samples(self) -> int:
        """``n``: samples per prompt."""
        return 1 if self.n is None else self.n

    def check_choices(
        self, prompts: int = 1, capacity: int = MAX_CHOICES, share: tuple[int, int] | None = None
    ) -> None:
        """``InvalidRequest`` for an ``n`` out of range or more choices than ``MAX_CHOICES``, the server's
        ``capacity`` (the requests it holds at once) or the caller's ``share`` (its live requests and streams, at
        most): a body beyond them could never be admitted whole; checked before any work."""
        if self.samples < 1:
            raise InvalidRequest("n", f"must be >= 1, got {self.n}")
        requests, streams = share or (capacity, capacity)
        limits = [
            (MAX_CHOICES, "choices per request"),
            (capacity, "requests this server holds at once"),
            (requests, "live requests of one caller (CDB_MAX_REQUESTS_PER_CALLER)"),
        ]
        if self.stream:
            limits.append((streams, "open streams of one caller (CDB_MAX_STREAMS_PER_CALLER)"))
        limit, held = min(limits, key=lambda item: item[0])
        if prompts * self.samples > limit:
            field = "n" if self.samples > 1 else "prompt"
            raise InvalidRequest(field, f"{prompts} prompts x n {self.samples} exceed the {limit} {held}")
        if self.resume is not None and prompts * self.samples > 1:
            raise InvalidRequest("resume", "continues one broken stream: send one prompt and n = 1")

    def params(
        self, max_tokens: int, logprobs: int | None, defaults: GenerationDefaults | None = None, sample: int = 0
    ) -> RequestParams:
        """The engine's parameters of the request's sample ``sample`` (its seed: ``sample_seed``)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        sampling = self.sampling(logprobs, defaults)
        if self.prompt_logprobs is not None:  # the prompt's alternatives come from the same count
            sampling = replace(sampling, logprobs=max(sampling.logprobs, self.prompt_logprobs))
        return RequestParams(
            max_tokens=max_tokens,
            sampling=replace(sampling, seed=sample_seed(sampling.seed, sample)),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop_strings=tuple(stop),
            exit_threshold=self.exit_threshold,
            speculative=self.speculative,
            ignore_eos=self.ignore_eos,
            resume_tokens=tuple(self.resume.token_ids) if self.resume else (),
            resume_depths=tuple(self.resume.depths) if self.resume else (),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs is not None,
            priority=self.priority,
            structure=self.structure(),
            cache_salt=self.cache_salt or "",
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: Any = Field(description="a string, a list of token ids, or a list of those (one choice each)")
    logprobs: StrictInt | None = None
    echo: StrictBool = False  # begin each choice with its prompt (with logprobs: the prompt's, at full depth)
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, str) or _is_ids(v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, str) or _is_ids(p) for p in v):
            return v  # a list of prompts
        raise ValueError("must be a string, a non-empty list of token ids, or a non-empty list of those")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or a list of them (each a string or token ids)."""
        if isinstance(self.prompt, str) or _is_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def choices(self) -> list[tuple[int, str | list[int], int]]:
        """``(index, prompt, sample)`` of every choice, in index order (``check_choices`` first)."""
        n = self.samples
        return [(i * n + j, p, j) for i, p in enumerate(self.prompts()) for j in range(n)]

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of is not None and self.best_of != 1:
            raise InvalidRequest("best_of", f"only best_of=1 is supported, got {self.best_of}")
        if self.suffix:
            raise InvalidRequest("suffix", "not supported (omit it)")
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequest("logprobs", f"must be >= 0, got {self.logprobs}")

    def output_logprobs(self) -> int | None:
        return self.logprobs

    def requested_max_tokens(self) -> int:
        """OpenAI's default for completions: 16; 0 generates nothing (with ``echo``: the prompt, scored)."""
        return 16 if self.max_tokens is None else self.max_tokens

    def to_engine(
        self, defaults: GenerationDefaults | None = None, prompt: str | list[int] | None = None, sample: int = 0
    ) -> tuple[str | list[int], RequestParams]:
        """The engine request of one choice: ``prompt`` (default: the only one) and its sample ``sample``."""
        self.refuse_unsupported()
        params = self.params(self.requested_max_tokens(), self.logprobs, defaults, sample)
        if self.echo and self.logprobs is not None:  # the prefill scores the prompt
            params = replace(params, prompt_logprobs=True)
        return self.prompts()[0] if prompt is None else prompt, params


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
    tools: list[Any] | None = None  # OpenAI's function tools: given to the chat template (``services.http.tools``)
    tool_choice: Any = None  # none, required or a named function forces a call; auto (with tools) is refused
    parallel_tool_calls: StrictBool | None = None  # false: a required call is one call
    add_generation_prompt: StrictBool = True  # the template opens the assistant's turn
    chat_template_kwargs: dict[str, Any] | None = None  # more variables of the chat template (vLLM's)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise InvalidRequest("messages", "must not be empty")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise InvalidRequest("top_logprobs", f"must be >= 0, got {self.top_logprobs}")
        requested = self.requested_max_tokens()
        if requested is not None and requested < 1:  # (a completion's 0 scores its prompt; a chat has no echo)
            raise InvalidRequest("max_tokens", f"must be >= 1, got {requested}")

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (or the deprecated ``max_tokens``); None: up to the context limit."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_call(self) -> ToolCall | None:
        """The tool call ``tool_choice`` forces (None: none), or ``InvalidRequest`` naming the field."""
        return tool_call(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structure(self) -> Structure | None:
        """As a completion's, and a forced tool call's (``tool_choice``), the last in order."""
        call = self.tool_call()
        return one_of([*request_structure(self), ("tool_choice", lambda: call.structure if call else None)])

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them: role and content (null: empty), with an assistant's
        ``tool_calls`` and a tool's ``tool_call_id`` when given."""
        keys = ("tool_calls", "tool_call_id")
        return [
            {"role": m.role, "content": m.content or ""}
            | {k: v for k, v in (m.model_extra or {}).items() if k in keys and v is not None}
            for m in self.messages
        ]

    def to_params(self, max_tokens: int, defaults: GenerationDefaults | None = None, sample: int = 0) -> RequestParams:
        """The engine's parameters of sample ``sample`` (after ``refuse_unsupported``)."""
        return self.params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults, sample)


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
