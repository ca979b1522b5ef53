"""The typed values of the clients' calls and their protobuf conversions: ``GenerateOptions`` into a
``GenerateRequest``; stream items (``StreamToken``, ``StreamFinish``), a whole ``GenerateResult`` and
``ServerInfo`` out of the responses."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from cdb_api.v1 import generation_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: "unspecified",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


class GenerateOptions(TypedDict, total=False):
    """Per-request options (see ``protos/cdb_api/v1/generation.proto`` for the meaning and limits)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: bool  # return the sampled token's logprob
    top_logprobs: int  # and this many alternatives
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    exit_threshold: float
    ignore_eos: bool
    request_id: str
    replay_depths: Sequence[int]  # benchmarks: servers started with --allow-replay-depths
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float]  # token id -> bias
    min_tokens: int
    speculative: bool  # self-speculative decoding for this request (unset: the server's choice)
    json_schema: str  # structured output (one at most): the text follows this JSON schema (its JSON text),
    json_object: bool  # is a JSON object,
    regex: str  # matches this regular expression,
    choice: Sequence[str]  # is one of these strings,
    grammar: str  # or is a sentence of this grammar (Lark or GBNF)


def build_request(prompt: str | Sequence[int], options: GenerateOptions) -> pb.GenerateRequest:
    """A ``GenerateRequest`` for a text or token-id prompt."""
    req = pb.GenerateRequest(
        request_id=options.get("request_id", ""), ignore_eos=options.get("ignore_eos", False), batch_tokens=True
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    if "max_tokens" in options:
        req.max_tokens = options["max_tokens"]
    s = req.sampling
    s.temperature = options.get("temperature", 0.0)
    s.top_k = options.get("top_k", 0)
    if "top_p" in options:
        s.top_p = options["top_p"]
    s.seed = options.get("seed", 0)
    s.return_logprobs = options.get("logprobs", False) or options.get("top_logprobs", 0) > 0
    s.top_logprobs = options.get("top_logprobs", 0)
    s.presence_penalty = options.get("presence_penalty", 0.0)
    s.frequency_penalty = options.get("frequency_penalty", 0.0)
    if "repetition_penalty" in options:
        s.repetition_penalty = options["repetition_penalty"]
    s.logit_bias.update(options.get("logit_bias", {}))
    s.min_tokens = options.get("min_tokens", 0)
    req.stop_strings.extend(options.get("stop", ()))
    req.stop_token_ids.extend(options.get("stop_token_ids", ()))
    if "exit_threshold" in options:
        req.exit_threshold = options["exit_threshold"]
    if "speculative" in options:
        req.speculative = options["speculative"]
    req.replay_depths.extend(options.get("replay_depths", ()))
    so = req.structured_output
    for key in ("json_schema", "json_object", "regex", "grammar"):
        if key in options:
            setattr(so, key, options[key])
    if "choice" in options:
        so.choice.choices.extend(options["choice"])
    return req


@dataclass(frozen=True, slots=True)
class StreamToken:
    """One generated token of a stream."""

    request_id: str
    id: int
    text: str
    depth: int  # loop depth the token was served at
    logprob: float | None = None
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    time_unix_nano: int = 0  # when the server produced it (tokens of one loop step share it)
    is_token: bool = field(default=True, init=False)


@dataclass(frozen=True, slots=True)
class StreamFinish:
    """The last item of a stream. A stream the client resumed (``Client.stream``) counts its whole generation in
    ``generated_tokens`` and ``total_loop_steps``, ``resumed_tokens`` of them delivered before its last attempt (the
    server's ``Usage`` counts only the tokens its own attempt generated)."""

    request_id: str
    finish_reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    generated_tokens: int
    total_loop_steps: int
    text: str = ""  # held-back text, to append
    error: str = ""
    resumed_tokens: int = 0
    is_token: bool = field(default=False, init=False)


def token_from_pb(request_id: str, tok: pb.Token) -> StreamToken:
    lp = tok.logprobs if tok.HasField("logprobs") else None
    return StreamToken(
        request_id,
        tok.id,
        tok.text,
        tok.depth,
        lp.logprob if lp is not None else None,
        tuple(lp.top_ids) if lp is not None else (),
        tuple(lp.top_logprobs) if lp is not None else (),
        tok.time_unix_nano,
    )


def finish_from_pb(request_id: str, fin: pb.Finish) -> StreamFinish:
    u = fin.usage
    return StreamFinish(
        request_id,
        FINISH_REASONS.get(fin.reason, "unspecified"),
        u.prompt_tokens,
        u.generated_tokens,
        u.total_loop_steps,
        fin.text,
        fin.error,
        u.resumed_tokens,
    )


def stream_items(msg: pb.GenerateStreamResponse) -> list[StreamToken | StreamFinish]:
    """The tokens (one, or several sent together: ``batch_tokens``) or the finish of one stream message."""
    which = msg.WhichOneof("event")
    if which == "token":
        return [token_from_pb(msg.request_id, msg.token)]
    if which == "tokens":
        return [token_from_pb(msg.request_id, t) for t in msg.tokens.tokens]
    return [finish_from_pb(msg.request_id, msg.finish)]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A whole generation."""

    request_id: str
    text: str
    tokens: tuple[StreamToken, ...]
    finish: StreamFinish

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    @property
    def depths(self) -> list[int]:
        return [t.depth for t in self.tokens]

    @classmethod
    def from_pb(cls, msg: pb.GenerateResponse) -> GenerateResult:
        tokens = tuple(token_from_pb(msg.request_id, t) for t in msg.tokens)
        return cls(msg.request_id, msg.text, tokens, finish_from_pb(msg.request_id, msg.finish))


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """Model, limits and live counters of a server (``Info``)."""

    model: str
    architecture: str
    max_depth: int
    vocab_size: int
    kv_policy: str
    mode: str
    deployment: str
    dtype: str
    kv_block_size: int
    healthy: bool
    error: str
    limits: dict[str, int]
    counters: dict[str, int]
    stage_pids: dict[str, int] = field(default_factory=dict)  # the process serving each stage role
    recovery_seconds: tuple[float, ...] = ()  # each healed stage loss: loss -> every stage re-attached
    config: dict[str, Any] = field(default_factory=dict)  # the server's resolved configuration (engine, settings)
    config_digest: str = ""  # SHA-256 of that configuration
    stage_config_digests: dict[str, str] = field(default_factory=dict)  # the same of each stage process
    # self-speculative decoding: mode, why unsupported, limits, and drafts / verdicts since start (``Speculation``)
    speculation: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, m: pb.InfoResponse) -> ServerInfo:
        limits = {f.name: getattr(m.limits, f.name) for f in m.limits.DESCRIPTOR.fields}
        counters = {f.name: getattr(m.counters, f.name) for f in m.counters.DESCRIPTOR.fields}
        return cls(
            m.model,
            m.architecture,
            m.max_depth,
            m.vocab_size,
            m.kv_policy,
            m.mode,
            m.deployment,
            m.dtype,
            m.kv_block_size,
            m.healthy,
            m.error,
            limits,
            counters,
            dict(m.stage_pids),
            tuple(m.recovery_seconds),
            json.loads(m.config_json) if m.config_json else {},
            m.config_digest,
            dict(m.stage_config_digests),
            {f.name: getattr(m.speculation, f.name) for f in m.speculation.DESCRIPTOR.fields},
        )
