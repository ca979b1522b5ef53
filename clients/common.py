"""Typed values shared by the sync and asyncio clients, their protobuf conversions, and channel creation.

Clients depend on ``grpc`` and the generated ``cdb_api`` stubs only (no torch, no engine), so they install
anywhere. Errors are ``grpc.RpcError`` with the server's status code (INVALID_ARGUMENT names the field,
UNAUTHENTICATED a missing or wrong API key).

A secured server: ``TlsOptions`` (the CA that signed the server's certificate; a client certificate and key for
mTLS) and an API key, sent as ``authorization: Bearer KEY`` on every call (``api_key_metadata``).
``open_channel`` is the one place a channel is made: one address or several replicas, the load-balancing and
retry policies (``clients.balancing``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypedDict, overload

import grpc
from grpc_health.v1 import health_pb2_grpc

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from clients.balancing import LbPolicy, RetryPolicy, channel_options, channel_target

ChannelOptions = Sequence[tuple[str, str | int]]
DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """TLS of a client channel, PEM bytes. ``root_certificates`` None: the system's trusted roots."""

    root_certificates: bytes | None = None  # the CA bundle that signed the server's certificate
    certificate_chain: bytes | None = None  # mTLS: this client's certificate ...
    private_key: bytes | None = field(default=None, repr=False)  # ... and its key
    server_name: str | None = None  # the name to check in the server's certificate, if not the address's host

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate and its private key go together: give both or neither")

    @classmethod
    def from_files(
        cls,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        server_name: str | None = None,
    ) -> TlsOptions:
        """Read PEM files (any may be None); raises ValueError naming an unreadable file."""
        return cls(_read_file(ca, "CA"), _read_file(cert, "client certificate"), _read_file(key, "key"), server_name)


def _read_file(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None


def read_api_key_file(path: str) -> str:
    """The API key in ``path``: its first line that is neither empty nor a ``#`` comment."""
    data = _read_file(path, "API key")
    assert data is not None
    for line in data.decode("utf-8", errors="replace").splitlines():
        if (key := line.strip()) and not key.startswith("#"):
            return key
    raise ValueError(f"the API key file {path} holds no key")


def api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries ``api_key`` (none for None or an empty key)."""
    if not api_key:
        return ()
    if any(c.isspace() for c in api_key) or not api_key.isascii() or not api_key.isprintable():
        raise ValueError("an API key is printable ASCII without spaces")
    return (("authorization", f"Bearer {api_key}"),)


@overload
def open_channel(
    address: str | Sequence[str],
    *,
    tls: TlsOptions | None = ...,
    aio: Literal[False] = ...,
    options: ChannelOptions = ...,
    lb_policy: LbPolicy | str = ...,
    retry: RetryPolicy | None = ...,
) -> grpc.Channel: ...


@overload
def open_channel(
    address: str | Sequence[str],
    *,
    tls: TlsOptions | None = ...,
    aio: Literal[True],
    options: ChannelOptions = ...,
    lb_policy: LbPolicy | str = ...,
    retry: RetryPolicy | None = ...,
) -> grpc.aio.Channel: ...


@overload
def open_channel(
    address: str | Sequence[str],
    *,
    tls: TlsOptions | None = ...,
    aio: bool,
    options: ChannelOptions = ...,
    lb_policy: LbPolicy | str = ...,
    retry: RetryPolicy | None = ...,
) -> grpc.Channel | grpc.aio.Channel: ...


def open_channel(
    address: str | Sequence[str],
    *,
    tls: TlsOptions | None = None,
    aio: bool = False,
    options: ChannelOptions = (),
    lb_policy: LbPolicy | str = LbPolicy.ROUND_ROBIN,
    retry: RetryPolicy | None = DEFAULT_RETRY,
) -> grpc.Channel | grpc.aio.Channel:
    """A channel to ``address``: ``HOST:PORT``, ``unix:PATH``, a gRPC target (``dns:///NAME:PORT``), or several
    IP:PORT addresses (a sequence or comma-separated) to balance over (``clients.balancing``). ``lb_policy``:
    ``round_robin`` or ``pick_first``; ``retry``: the retry policy of ``cdb.v1.Generation`` calls (None: no
    retries); ``options``: more channel arguments, which win over the defaults. TLS with ``tls``, else plaintext;
    ``aio``: a ``grpc.aio`` channel (create it inside a running event loop). Raises ValueError naming a bad
    address or policy."""
    target = channel_target(address)
    opts = channel_options(options, lb_policy, retry)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=opts) if aio else grpc.insecure_channel(target, options=opts)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
    if aio:
        return grpc.aio.secure_channel(target, credentials, options=opts)
    return grpc.secure_channel(target, credentials, options=opts)


def address_text(address: str | Sequence[str]) -> str:
    """``address`` as one string, for messages."""
    return address if isinstance(address, str) else ",".join(address)


Metadata = Sequence[tuple[str, str]]


class ClientBase:
    """What ``Client`` and ``AsyncClient`` share: the address, each call's default deadline and metadata, the API
    key, the channel (``grpc.aio`` when the class sets ``_AIO``) and its stubs."""

    _AIO: ClassVar[bool] = False
    channel: grpc.Channel | grpc.aio.Channel

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        tls: TlsOptions | None = None,
        api_key: str | None = None,
        lb_policy: LbPolicy | str = LbPolicy.ROUND_ROBIN,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        options: ChannelOptions = (),
    ) -> None:
        self.address = address_text(address)
        self.timeout = timeout
        self.metadata = tuple(metadata)  # e.g. W3C ``traceparent``, sent with every call
        self._auth = api_key_metadata(api_key)
        self.channel = open_channel(address, tls=tls, aio=self._AIO, lb_policy=lb_policy, retry=retry, options=options)
        self._stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _kw(self, timeout: float | None, metadata: Metadata) -> dict[str, object]:
        return {
            "timeout": self.timeout if timeout is None else timeout,
            "metadata": self.metadata + self._auth + tuple(metadata),
        }


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
    return req


RESUME_ATTEMPTS = 3  # a broken stream is resumed this many times at most (``resume_attempts``)
RESUME_WAIT_S = 30.0  # how long a resume waits for a server to be ready (a scheduler restarting)
ACCEPTED_HEADER = "cdb-request-id"  # GenerateStream's initial metadata: the server admitted the request


def accepted_id(metadata: object) -> str | None:
    """The request id a server sent when it admitted a stream (``ACCEPTED_HEADER``), or None: the call never
    reached a server that took it (nothing to wait for: a retry fails fast or goes elsewhere)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == ACCEPTED_HEADER:
            return value if isinstance(value, str) else bytes(value).decode()
    return None


def resumable(exc: grpc.RpcError, delivered: bool) -> bool:
    """Whether a stream that failed with ``exc`` is sent again: its server (or the connection) went away or is
    draining (UNAVAILABLE), or, before it ``delivered`` a token, it was refused for load (RESOURCE_EXHAUSTED);
    any other status is the request's own outcome."""
    code = exc.code() if hasattr(exc, "code") else None
    return code is grpc.StatusCode.UNAVAILABLE or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and not delivered)


def resume_request(
    request: pb.GenerateRequest, received: Sequence[StreamToken], request_id: str | None = None
) -> pb.GenerateRequest:
    """``request`` sent again to continue after the tokens ``received`` (``GenerateRequest.resume``), under the id
    the broken stream had (``request_id``: the one its server accepted it under), so that the stream's items keep
    one request id."""
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    if received:
        request_id = received[0].request_id
        again.resume.token_ids.extend(t.id for t in received)
        again.resume.depths.extend(t.depth for t in received)
    if request_id:
        again.request_id = request_id
    return again


def resume_delay(attempt: int) -> float:
    """Seconds to wait before resume attempt ``attempt`` (1, 2, ...): 50 ms doubling, at most 1 s."""
    return min(1.0, 0.05 * 2 ** (attempt - 1))


class Resumption:
    """One stream across its attempts (``Client.stream`` / ``AsyncClient.stream``): what it delivered, the id a
    server accepted it under, the attempts left and the deadline of them all."""

    def __init__(self, request: pb.GenerateRequest, attempts: int, budget: float | None) -> None:
        self.request = request
        self.attempts = attempts
        self.deadline = None if budget is None else time.monotonic() + budget
        self.received: list[StreamToken] = []
        self.accepted: str | None = None  # the id a server admitted the request under
        self.attempt = 0
        self.error: grpc.RpcError | None = None

    def next_request(self) -> pb.GenerateRequest:
        return resume_request(self.request, self.received, self.accepted)

    def left(self) -> float | None:
        """Seconds left of the deadline (None: no deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def keep(self, item: StreamToken | StreamFinish) -> StreamToken | StreamFinish:
        if isinstance(item, StreamToken):
            self.received.append(item)
        return item

    def failed(self, exc: grpc.RpcError, initial_metadata: object) -> tuple[bool, float]:
        """After attempt ``exc`` failed: ``(wait_for_ready, seconds)``. True: a server had taken the request and
        went away (restarting, draining): wait up to ``seconds`` for one to be ready, then send it again. False:
        it never reached one: sleep ``seconds`` and send it again. Raises ``exc`` when the stream must end."""
        self.attempt += 1
        if not resumable(exc, bool(self.received)) or self.attempt > self.attempts:
            raise exc
        self.error = exc
        self.accepted = self.accepted or accepted_id(initial_metadata)
        if self.accepted is None:
            return False, resume_delay(self.attempt)
        left = self.left()
        return True, RESUME_WAIT_S if left is None else min(RESUME_WAIT_S, left)


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
