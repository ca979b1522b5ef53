"""Typed values shared by the sync and asyncio clients, and their protobuf conversions.

Clients depend on ``grpc`` and the generated ``cdb_api`` stubs only (no torch, no engine), so they install
anywhere. Errors are ``grpc.RpcError`` with the server's status code (INVALID_ARGUMENT names the field).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

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


def build_request(prompt: str | Sequence[int], options: GenerateOptions) -> pb.GenerateRequest:
    """A ``GenerateRequest`` for a text or token-id prompt."""
    req = pb.GenerateRequest(request_id=options.get("request_id", ""), ignore_eos=options.get("ignore_eos", False))
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
    req.stop_strings.extend(options.get("stop", ()))
    req.stop_token_ids.extend(options.get("stop_token_ids", ()))
    if "exit_threshold" in options:
        req.exit_threshold = options["exit_threshold"]
    req.replay_depths.extend(options.get("replay_depths", ()))
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
    is_token: bool = field(default=True, init=False)


@dataclass(frozen=True, slots=True)
class StreamFinish:
    """The last item of a stream."""

    request_id: str
    finish_reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    generated_tokens: int
    total_loop_steps: int
    text: str = ""  # held-back text, to append
    error: str = ""
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
    )


def stream_item(msg: pb.GenerateStreamResponse) -> StreamToken | StreamFinish:
    if msg.WhichOneof("event") == "token":
        return token_from_pb(msg.request_id, msg.token)
    return finish_from_pb(msg.request_id, msg.finish)


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
        )
