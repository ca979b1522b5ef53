"""A deployment's configuration, read in this one place: the services' operational knobs (``Settings``) and the
engine options (``cdb_engine.config.EngineConfig``), one typed source (``cdb_engine.config_source``, on
pydantic-settings). Each value comes from, highest first: the process's command-line flag (``cdb serve``,
``cdb scheduler``, ``cdb stage``, ``cdb demo``), the ``CDB_*`` environment variable, the config file named by
``--config FILE`` or ``CDB_CONFIG`` (TOML, or YAML for ``.yaml``/``.yml``; its keys are the variables' names
without ``CDB_``, in lower case: ``max_num_seqs = 16``), the default below. ``auto`` (the model's own value) is
allowed where the default says so. The tables are the fields' own help (``metadata["help"]``):
``python -m services.settings`` prints them and a test holds this docstring equal to it.

A process resolves its configuration once, into ``Resolved`` (frozen: ``Settings`` + ``EngineConfig``). The
launcher hands its children that one record as a JSON document (``--resolved-config FILE``), which they read
instead of the environment and the config file: every process of a tree runs with the same values, and ``Info``
shows them (``config_json``) with their digest and each stage's digest.

| variable | default | meaning |
|---|---|---|
| ``CDB_CONFIG`` | (unset) | config file (TOML; YAML: .yaml/.yml) of any keys below; ``--config`` overrides it |
| ``CDB_STAGE_THREADS`` | 1 | torch intra-op threads per stage process (three stages share the host's cores) |
| ``CDB_FENCE_TIMEOUT_S`` | 600 | a stage fails a batch whose fences stay unmet this long (or the batch's own limit) |
| ``CDB_FENCE_SPIN_S`` | auto | spin on a fence or for the next op before sleeping; auto: 2e-4 s on 8+ cores, else 0 |
| ``CDB_STAGE_CONNECT_TIMEOUT_S`` | 120 | how long the scheduler waits for its stages to be ready at start |
| ``CDB_STAGE_KEEPALIVE_S`` | 5 | HTTP/2 keepalive ping interval on stage channels (a frozen stage is detected) |
| ``CDB_STAGE_PROBE_TIMEOUT_S`` | 2 | deadline of the health probe of each stage |
| ``CDB_HEALTH_INTERVAL_S`` | 0.5 | period of the scheduler's readiness check |
| ``CDB_STALL_TIMEOUT_S`` | 15 | work pending without engine progress this long: NOT_SERVING |
| ``CDB_DRAIN_TIMEOUT_S`` | 30 | SIGTERM: how long in-flight streams may finish before they are cancelled |
| ``CDB_MAX_CONCURRENT_RPCS`` | 1024 | hard cap of concurrent gRPC calls but health checks (RESOURCE_EXHAUSTED beyond) |
| ``CDB_READY_TIMEOUT_S`` | 180 | ``serve_all``: how long to wait for every child to become ready |
| ``CDB_UVLOOP`` | true | run the public server's event loop on uvloop when installed |
| ``CDB_METRICS_ADDR`` | (unset) | ``HOST:PORT`` of the scheduler's Prometheus endpoint (``:9464``: all interfaces) |
| ``CDB_CPUS`` | (unset) | pin the processes to CPUs, e.g. ``loop:1,head:0,prelude:0,scheduler:0`` (``+``: several) |
| ``CDB_STAGE_SECRET`` | (unset) | the stage plane's shared secret (prefer ``CDB_STAGE_SECRET_FILE``) |
| ``CDB_STAGE_SECRET_FILE`` | (unset) | file (mode 0600) holding the stage plane's secret; ``cdb serve`` makes one |
| ``CDB_STAGE_DOWN_LIMIT_S`` | 60 | a stage missing this long: requests fail ``UNAVAILABLE``, the scheduler exits 1 |
| ``CDB_RECONNECT_BACKOFF_S`` | 0.05 | first delay between reconnect attempts to a lost stage (doubles up to 0.5 s) |
| ``CDB_STAGE_HANG_FLOOR_S`` | 30 | no stage op is judged hung before it has run this long |
| ``CDB_STAGE_HANG_FACTOR`` | 20 | an op past this many times its expected time (pace x tokens): its stage is replaced |
| ``CDB_FRONTENDS`` | 0 | front-end processes serving the public ports (gRPC, HTTP); 0: the scheduler serves them |
| ``CDB_STANDBY_STAGES`` | false | a warm standby process per stage role: a lost stage is replaced at once (2x memory) |
| ``CDB_STAGE_RINGS`` | true | stage ops and replies travel on shared-memory rings (x86-64 Linux); false: on gRPC |
| ``CDB_STAGE_RING_BYTES`` | 4194304 | capacity of each stage ring (two per stage); the largest op or reply fits |
| ``CDB_CUDA_GRAPHS`` | true | on CUDA, decode loop ops replay graphs captured per width and context bucket |
| ``CDB_TLS_CERT`` | (unset) | PEM certificate chain of the public port (with ``CDB_TLS_KEY``: TLS on) |
| ``CDB_TLS_KEY`` | (unset) | PEM private key of the public port |
| ``CDB_TLS_CLIENT_CA`` | (unset) | PEM CA bundle: the public port requires client certificates signed by it (mTLS) |
| ``CDB_API_KEYS`` | (unset) | comma-separated API keys accepted as ``authorization: Bearer KEY`` on the public port |
| ``CDB_API_KEYS_FILE`` | (unset) | file with one API key per line (``#`` comments), merged with ``CDB_API_KEYS`` |
| ``CDB_MAX_STREAMS_PER_CONNECTION`` | 256 | HTTP/2 max concurrent streams per client connection of the public port |
| ``CDB_KEEPALIVE_MIN_TIME_S`` | 10 | clients may ping no more often than this (more often: GOAWAY) |
| ``CDB_MAX_REQUESTS_PER_CALLER`` | 256 | live generation requests of one caller (API key, else host), both APIs |
| ``CDB_MAX_STREAMS_PER_CALLER`` | 256 | streamed generations of one caller open at once (gRPC streams, SSE) |
| ``CDB_MAX_HEALTH_WATCHES`` | 256 | open health Watch streams of all callers (apart from the RPC cap) |
| ``CDB_STREAM_STALL_TIMEOUT_S`` | 60 | a stream whose client takes no message this long is cut, its request aborted |
| ``CDB_IDLE_CONNECTION_TIMEOUT_S`` | 300 | gRPC: a connection without calls this long is closed (GOAWAY) |
| ``CDB_HTTP_KEEP_ALIVE_S`` | 5 | HTTP: an idle keep-alive connection is closed after this long |
| ``CDB_HEADER_READ_TIMEOUT_S`` | 10 | time for a new connection's handshake (gRPC), for a request's headers (HTTP) |
| ``CDB_BODY_READ_TIMEOUT_S`` | 30 | HTTP: time for a request's whole body once its headers are in (else 408) |
| ``CDB_HTTP_ADDR`` | (unset) | ``HOST:PORT`` of the OpenAI HTTP API (``cdb serve``: 127.0.0.1:8000); empty: none |
| ``CDB_SERVED_MODEL_NAME`` | (unset) | model names the HTTP API accepts, comma-separated; the first is reported |
| ``CDB_CHAT_TEMPLATE`` | (unset) | HTTP API chat template: a Jinja file or the template; empty: the tokenizer's |
| ``CDB_MAX_REQUEST_BYTES`` | 4194304 | largest HTTP request body; more: 413 before parsing and the API-key check |
| ``CDB_STAGE_OP_LOG`` | (unset) | folder where each stage writes its per-op timeline (``cdb bench hostpath``) |
| ``CDB_RESTART_LIMIT`` | 5 | a child exiting this many times in a row without serving stops the tree (exit 1) |
| ``CDB_RESTART_BACKOFF_S`` | 0.5 | delay of a child's 2nd restart in a row (the 1st is at once); doubles per restart |
| ``CDB_RESTART_BACKOFF_MAX_S`` | 30 | longest delay between two restarts of a failing child |
| ``CDB_LOG_LEVEL`` | info | log level of every process of the tree: debug, info, warning or error |
| ``CDB_LOG_FORMAT`` | text | log lines as text, or json: one JSON object per line |
| ``CDB_REQUEST_LOG`` | false | log a line per finished request: id, caller, tokens, depth, reason, latency |
| ``CDB_THROUGHPUT_LOG_INTERVAL_S`` | 10 | period of the scheduler's throughput log line; 0: none |
| ``CDB_REQUEST_LATENCY_BUCKETS`` | (unset) | bucket bounds (s) of TTFT, end-to-end, queue time; empty: 1 ms..2 h |
| ``CDB_TOKEN_LATENCY_BUCKETS`` | (unset) | bucket bounds (s) of inter-token latency and TPOT; empty: 1 ms..60 s |

The engine options, the same for the four processes of a tree (each also ``--option`` of ``cdb serve``, ``cdb
scheduler`` and ``cdb demo``; ``cdb stage`` takes ``--model``, ``--dtype`` and ``--device``):

| variable | default | meaning |
|---|---|---|
| ``CDB_MODEL`` | ouro-tiny | a preset name (cdb presets) or a local checkpoint folder |
| ``CDB_DTYPE`` | auto | compute dtype; auto: bfloat16 on CUDA, float32 elsewhere |
| ``CDB_DEVICE`` | cpu | compute device of every process: cpu, cuda or cuda:N |
| ``CDB_MODE`` | cdb | cdb: refill freed loop slots at once; no-refill: lockstep waves; full-depth: no early exit |
| ``CDB_MAX_NUM_SEQS`` | 32 | resident requests = the width of the loop batch |
| ``CDB_NUM_KV_BLOCKS`` | 2048 | KV-cache blocks per pool |
| ``CDB_KV_BLOCK_SIZE`` | 16 | tokens per KV-cache block |
| ``CDB_KV_POLICY`` | last_exited | which loop-KV depth slot a token writes and reads (depth_indexed: as trained) |
| ``CDB_KV_SHARED_AFTER`` | 2 | first_then_shared: private KV slots for the first k-1 loop steps, then one shared |
| ``CDB_MAX_DEPTH`` | auto | loop steps per token at most; auto: the model's |
| ``CDB_EXIT_RULE`` | auto | what ends a token's loop; auto: the family's own (Ouro hazard, Huginn latent-diff) |
| ``CDB_EXIT_THRESHOLD`` | auto | Ouro gate CDF q in (0, 1], Huginn latent diff >= 0; auto: the model's or 0.5 / 0.1 |
| ``CDB_EARLY_EXIT`` | true | false (--no-early-exit): the server's default threshold serves every token at full depth |
| ``CDB_MIN_DEPTH`` | 1 | loop steps every token runs before it may exit |
| ``CDB_FIXED_DEPTH`` | auto | exit rule fixed: every token at this depth; auto: the max depth |
| ``CDB_HORIZON`` | one-ahead | one-ahead: exit decisions one loop step ahead; same-step: upstream's rule |
| ``CDB_PREFILL_TOKEN_BUDGET`` | 2048 | prompt tokens prefilled per scheduling step |
| ``CDB_PREFILL_CHUNK_SIZE`` | 512 | prompt tokens per prefill chunk |
| ``CDB_MIN_HEAD_BATCH_SIZE`` | auto | exited tokens the head waits for; auto: 1 for Ouro, max_num_seqs/4 for Huginn |
| ``CDB_MAX_HEAD_WAIT_STEPS`` | 4 | an exited token waits at most this many loop ops for a head batch of that size |
| ``CDB_LOOP_PIPELINE_DEPTH`` | 2 | loop ops in flight at once |
| ``CDB_MAX_INPUT_TOKENS`` | auto | longest prompt accepted; auto: the model's max positions - 1 |
| ``CDB_MAX_TOTAL_TOKENS`` | auto | prompt + max_tokens at most; auto: the model's max positions |
| ``CDB_MAX_WAITING`` | 256 | bounded waiting queue: beyond it, requests get RESOURCE_EXHAUSTED |
| ``CDB_INIT_SEED`` | -1 | Huginn initial state: < 0 zero, else a seeded truncated normal per position |
| ``CDB_NUM_THREADS`` | auto | torch intra-op threads of the in-process executor; auto: torch's default |
| ``CDB_FUSE_REFILL_EMBED`` | true | Ouro: the head op embeds a refill's input token (no prelude op per step) |
| ``CDB_FUSE_LOOP_HEAD`` | true | Ouro: loop ops sample the exited tokens and run their successors (no head op) |
| ``CDB_SPECULATIVE`` | auto | self-speculative decoding: auto (adaptive, while rows are free), on, off |
| ``CDB_SPECULATIVE_TOKENS`` | 4 | tokens of one request running ahead of its oldest unverified one, at most |
| ``CDB_SPECULATIVE_MAX_OCCUPANCY`` | auto | draft below this share of max_num_seqs per op; auto: 0.5 GPU, 0.25 CPU |
| ``CDB_SPECULATIVE_DEPTH`` | auto | loop steps a token runs before its successor is drafted; auto: 1, adaptive |
| ``CDB_ALLOW_REPLAY_DEPTHS`` | false | accept per-request replayed depths (benchmarks; implied by exit rule replay) |
| ``CDB_SYNTHETIC_COST`` | (unset) | synthetic stages, modelled device time: loop=A:B:C,head=.. (µs) or h200:ouro-1.4b |
| ``CDB_SYNTHETIC_DEPTHS`` | (unset) | synthetic exit depths MEAN:MIN[:ACCEPT]; empty: 2.5:2 Ouro, 6:3 Huginn |
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from cdb_engine.config import EngineConfig
from cdb_engine.config_source import (
    CONFIG_ENV,
    ENGINE_FIELDS,
    SourceError,
    SourceValues,
    check_engine_field,
    env_name,
    read_source,
)
from services.net import is_host_port


class SettingsError(SourceError):
    """A ``CDB_*`` variable or a config-file key does not parse or is out of range."""


def _help(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    return field(default=default, metadata={"help": text}, **kw)


SPIN_MIN_CPUS = 8  # ``fence_spin_s`` auto: spin only where the tree's processes leave cores to spare
_SPIN_S = 2e-4


@dataclass(frozen=True, slots=True)
class Settings:
    """Operational knobs of the stage servers, the scheduler service and the launcher."""

    stage_threads: int = _help("torch intra-op threads per stage process (three stages share the host's cores)", 1)
    fence_timeout_s: float = _help(
        "a stage fails a batch whose fences stay unmet this long (or the batch's own limit)", 600.0
    )
    fence_spin_s: float | None = _help(
        f"spin on a fence or for the next op before sleeping; auto: 2e-4 s on {SPIN_MIN_CPUS}+ cores, else 0",
        None,
    )
    stage_connect_timeout_s: float = _help("how long the scheduler waits for its stages to be ready at start", 120.0)
    stage_keepalive_s: float = _help(
        "HTTP/2 keepalive ping interval on stage channels (a frozen stage is detected)", 5.0
    )
    stage_probe_timeout_s: float = _help("deadline of the health probe of each stage", 2.0)
    health_interval_s: float = _help("period of the scheduler's readiness check", 0.5)
    stall_timeout_s: float = _help("work pending without engine progress this long: NOT_SERVING", 15.0)
    drain_timeout_s: float = _help("SIGTERM: how long in-flight streams may finish before they are cancelled", 30.0)
    max_concurrent_rpcs: int = _help(
        "hard cap of concurrent gRPC calls but health checks (RESOURCE_EXHAUSTED beyond)", 1024
    )
    ready_timeout_s: float = _help("``serve_all``: how long to wait for every child to become ready", 180.0)
    uvloop: bool = _help("run the public server's event loop on uvloop when installed", True)
    metrics_addr: str = _help("``HOST:PORT`` of the scheduler's Prometheus endpoint (``:9464``: all interfaces)", "")
    cpus: str = _help("pin the processes to CPUs, e.g. ``loop:1,head:0,prelude:0,scheduler:0`` (``+``: several)", "")
    stage_secret: str = _help("the stage plane's shared secret (prefer ``CDB_STAGE_SECRET_FILE``)", "", repr=False)
    stage_secret_file: str = _help("file (mode 0600) holding the stage plane's secret; ``cdb serve`` makes one", "")
    stage_down_limit_s: float = _help(
        "a stage missing this long: requests fail ``UNAVAILABLE``, the scheduler exits 1", 60.0
    )
    reconnect_backoff_s: float = _help(
        "first delay between reconnect attempts to a lost stage (doubles up to 0.5 s)", 0.05
    )
    stage_hang_floor_s: float = _help("no stage op is judged hung before it has run this long", 30.0)
    stage_hang_factor: float = _help(
        "an op past this many times its expected time (pace x tokens): its stage is replaced", 20.0
    )
    frontends: int = _help("front-end processes serving the public ports (gRPC, HTTP); 0: the scheduler serves them", 0)
    standby_stages: bool = _help(
        "a warm standby process per stage role: a lost stage is replaced at once (2x memory)", False
    )
    stage_rings: bool = _help(
        "stage ops and replies travel on shared-memory rings (x86-64 Linux); false: on gRPC", True
    )
    stage_ring_bytes: int = _help("capacity of each stage ring (two per stage); the largest op or reply fits", 4 << 20)
    cuda_graphs: bool = _help("on CUDA, decode loop ops replay graphs captured per width and context bucket", True)
    tls_cert: str = _help("PEM certificate chain of the public port (with ``CDB_TLS_KEY``: TLS on)", "")
    tls_key: str = _help("PEM private key of the public port", "")
    tls_client_ca: str = _help("PEM CA bundle: the public port requires client certificates signed by it (mTLS)", "")
    api_keys: str = _help(
        "comma-separated API keys accepted as ``authorization: Bearer KEY`` on the public port", "", repr=False
    )
    api_keys_file: str = _help("file with one API key per line (``#`` comments), merged with ``CDB_API_KEYS``", "")
    max_streams_per_connection: int = _help(
        "HTTP/2 max concurrent streams per client connection of the public port", 256
    )
    keepalive_min_time_s: float = _help("clients may ping no more often than this (more often: GOAWAY)", 10.0)
    max_requests_per_caller: int = _help("live generation requests of one caller (API key, else host), both APIs", 256)
    max_streams_per_caller: int = _help("streamed generations of one caller open at once (gRPC streams, SSE)", 256)
    max_health_watches: int = _help("open health Watch streams of all callers (apart from the RPC cap)", 256)
    stream_stall_timeout_s: float = _help(
        "a stream whose client takes no message this long is cut, its request aborted", 60.0
    )
    idle_connection_timeout_s: float = _help("gRPC: a connection without calls this long is closed (GOAWAY)", 300.0)
    http_keep_alive_s: float = _help("HTTP: an idle keep-alive connection is closed after this long", 5.0)
    header_read_timeout_s: float = _help(
        "time for a new connection's handshake (gRPC), for a request's headers (HTTP)", 10.0
    )
    body_read_timeout_s: float = _help("HTTP: time for a request's whole body once its headers are in (else 408)", 30.0)
    http_addr: str = _help("``HOST:PORT`` of the OpenAI HTTP API (``cdb serve``: 127.0.0.1:8000); empty: none", "")
    served_model_name: str = _help("model names the HTTP API accepts, comma-separated; the first is reported", "")
    chat_template: str = _help("HTTP API chat template: a Jinja file or the template; empty: the tokenizer's", "")
    max_request_bytes: int = _help("largest HTTP request body; more: 413 before parsing and the API-key check", 4 << 20)
    stage_op_log: str = _help(
        "folder where each stage writes its per-op timeline (``cdb bench hostpath``)",
        "",
    )
    restart_limit: int = _help("a child exiting this many times in a row without serving stops the tree (exit 1)", 5)
    restart_backoff_s: float = _help(
        "delay of a child's 2nd restart in a row (the 1st is at once); doubles per restart", 0.5
    )
    restart_backoff_max_s: float = _help("longest delay between two restarts of a failing child", 30.0)
    log_level: str = _help("log level of every process of the tree: debug, info, warning or error", "info")
    log_format: str = _help("log lines as text, or json: one JSON object per line", "text")
    request_log: bool = _help("log a line per finished request: id, caller, tokens, depth, reason, latency", False)
    throughput_log_interval_s: float = _help("period of the scheduler's throughput log line; 0: none", 10.0)
    request_latency_buckets: str = _help("bucket bounds (s) of TTFT, end-to-end, queue time; empty: 1 ms..2 h", "")
    token_latency_buckets: str = _help("bucket bounds (s) of inter-token latency and TPOT; empty: 1 ms..60 s", "")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if problem := _problem(f.name, value):
                raise SettingsError(f"{env_name(f.name)}={value!r}: {problem}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingsError("CDB_TLS_CERT and CDB_TLS_KEY go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise SettingsError("CDB_TLS_CLIENT_CA needs CDB_TLS_CERT and CDB_TLS_KEY (mTLS is TLS first)")

    @property
    def spin_s(self) -> float:
        """``fence_spin_s`` resolved on this host (auto: spin only where there are cores to spare)."""
        if self.fence_spin_s is not None:
            return self.fence_spin_s
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return _SPIN_S if usable >= SPIN_MIN_CPUS else 0.0


_ADDRESSES = frozenset({"metrics_addr", "http_addr"})
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
_CHOICES = {"log_level": LOG_LEVELS, "log_format": LOG_FORMATS}
_BUCKETS = frozenset({"request_latency_buckets", "token_latency_buckets"})
SETTINGS_FIELDS = tuple(f.name for f in fields(Settings))
PROCESS_ROLES = ("prelude", "loop", "head", "scheduler", "frontend")


def _problem(name: str, value: Any) -> str | None:
    """What is wrong with one setting's value on its own, or None."""
    if name == "served_model_name":
        return "must be names separated by commas, none empty" if value and "" in served_names(value) else None
    if name in _CHOICES:
        return None if value in _CHOICES[name] else f"must be one of {', '.join(_CHOICES[name])}"
    if name in _BUCKETS:
        try:
            parse_buckets(value)
        except ValueError as exc:
            return str(exc)
        return None
    if name == "cpus":
        try:
            cpu_map(value)
        except SettingsError as exc:
            return str(exc).removeprefix("CDB_CPUS ")
        return None
    if isinstance(value, str):
        return "must be HOST:PORT (or :PORT)" if name in _ADDRESSES and value and not is_host_port(value) else None
    if isinstance(value, bool):
        return None
    if value is None:  # auto
        return None
    if name in ("fence_spin_s", "throughput_log_interval_s", "frontends"):
        return None if value >= 0 else "must be >= 0"
    return None if value > 0 else "must be positive"


def served_names(spec: str) -> list[str]:
    """``a, b`` -> ``["a", "b"]``: the model names of ``CDB_SERVED_MODEL_NAME`` (``--served-model-name``), the first
    the one reported; [] for an empty spec (the API serves the model under its ``--model``)."""
    return [name.strip() for name in spec.split(",")] if spec.strip() else []


def parse_buckets(spec: str) -> tuple[float, ...]:
    """``0.1,1,10`` -> histogram bucket upper bounds (seconds, increasing, positive); () for an empty spec (the
    built-in buckets); ValueError naming the problem."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    try:
        bounds = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"must be comma-separated numbers of seconds, got {spec!r}") from None
    if any(not b > 0 or b == float("inf") for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise ValueError(f"must be finite positive bounds in increasing order, got {spec!r}")
    return bounds


def cpu_map(spec: str) -> dict[str, set[int]]:
    """``loop:1,head:0+1`` -> CPUs by process role; SettingsError naming the problem."""
    out: dict[str, set[int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        role, sep, cpus = part.partition(":")
        try:
            if not sep or role not in PROCESS_ROLES:
                raise ValueError
            out[role] = {int(c) for c in cpus.split("+")}
        except ValueError:
            raise SettingsError(
                f"CDB_CPUS must be ROLE:CPU[+CPU...] pairs with ROLE in {'|'.join(PROCESS_ROLES)}, got {part!r}"
            ) from None
    return out


def _check(name: str, value: Any) -> None:
    if name in ENGINE_FIELDS:
        check_engine_field(name, value)
    elif problem := _problem(name, value):
        raise ValueError(problem)


@dataclass(frozen=True)
class Configuration:
    """One process's configuration from the source: its ``settings`` and the engine fields the environment or
    the config file set (``engine``: the defaults of its engine flags; ``origins``: where each value came from)."""

    settings: Settings
    engine: Mapping[str, Any]
    origins: Mapping[str, str]
    config_file: str | None

    def engine_config(self, **flags: Any) -> EngineConfig:
        """``EngineConfig`` of the source's values with ``flags`` over them."""
        return EngineConfig(**{**self.engine, **flags})


def load_configuration(environ: Mapping[str, str] | None = None, config_file: str | None = None) -> Configuration:
    """Read the ``CDB_*`` variables (default: ``os.environ``) over the config file (``config_file``, else
    ``CDB_CONFIG``) over the defaults, every service and engine field; SettingsError naming a bad value. Cached
    (a process reads them once): the same environment and file give the same result."""
    try:
        source = read_source((Settings, EngineConfig), environ, config_file, check=_check)
        known = _CONFIGURATIONS.get(id(source))
        if known is not None and known[0] is source:
            return known[1]
        settings = Settings(**source.subset(SETTINGS_FIELDS))
    except SettingsError:
        raise
    except SourceError as exc:
        raise SettingsError(str(exc)) from None
    conf = Configuration(settings, source.subset(ENGINE_FIELDS), source.origins, source.config_file)
    _CONFIGURATIONS[id(source)] = (source, conf)
    return conf


_CONFIGURATIONS: dict[int, tuple[SourceValues, Configuration]] = {}  # read_source's results (cached) -> ours


def load_settings(environ: Mapping[str, str] | None = None, config_file: str | None = None) -> Settings:
    """The services' settings from ``CDB_*`` variables (default: ``os.environ``) and the config file over the
    defaults; raises SettingsError (also for a bad engine value: the source is validated whole)."""
    return load_configuration(environ, config_file).settings


HIDDEN = "(hidden)"  # a secret's value as Info shows it


@dataclass(frozen=True, slots=True)
class Resolved:
    """The whole configuration a process runs with, resolved once (flags > ``CDB_*`` > config file > defaults).

    ``to_json`` is the document the launcher hands its children (secrets included: written 0600); ``shown`` is
    what ``Info`` reports (secrets hidden) and ``digest`` its SHA-256, equal across the processes of a tree."""

    settings: Settings
    engine: EngineConfig

    def _values(self, hide: bool) -> dict[str, dict[str, Any]]:
        def record(obj: Any) -> dict[str, Any]:
            out = {}
            for f in fields(obj):
                value = getattr(obj, f.name)
                out[f.name] = HIDDEN if hide and not f.repr and value else value  # repr=False: a secret
            return out

        return {"engine": record(self.engine), "settings": record(self.settings)}

    def to_json(self) -> str:
        return json.dumps(self._values(hide=False), sort_keys=True)

    def shown(self) -> str:
        """The values as JSON (keys sorted, one line), secrets replaced by ``(hidden)``."""
        return json.dumps(self._values(hide=True), sort_keys=True)

    def digest(self) -> str:
        """SHA-256 (hex) of ``shown()``."""
        return hashlib.sha256(self.shown().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str, where: str = "the resolved configuration") -> Resolved:
        """The record of ``to_json``'s document; SettingsError naming ``where`` when it is not one."""
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or set(doc) != {"engine", "settings"}:
                raise ValueError("want an object of 'engine' and 'settings'")
            return cls(Settings(**doc["settings"]), EngineConfig(**doc["engine"]))
        except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError; TypeError: a key that is no field
            raise SettingsError(f"{where}: not a resolved configuration ({exc})") from None

    def write(self, path: str) -> None:
        """Write ``to_json()`` to ``path``, readable by its owner only (it holds the secrets)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.to_json())

    @classmethod
    def read(cls, path: str) -> Resolved:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise SettingsError(f"--resolved-config={path!r}: {exc.strerror or exc}") from None
        return cls.from_json(text, path)


def handed_configuration(path: str) -> Configuration:
    """The configuration a launcher handed this process (``--resolved-config FILE``, ``Resolved.write``): the
    whole source under the process's flags; the environment and config files are not read."""
    resolved = Resolved.read(path)
    engine = {name: getattr(resolved.engine, name) for name in ENGINE_FIELDS}
    return Configuration(resolved.settings, engine, dict.fromkeys([*SETTINGS_FIELDS, *ENGINE_FIELDS], path), None)


def _default_text(value: Any) -> str:
    if value is None:
        return "auto"
    if value == "":
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def variables_table() -> str:
    """The tables of this module's docstring, from the fields' help."""
    head = "| variable | default | meaning |\n|---|---|---|\n"
    config = f"| ``{CONFIG_ENV}`` | (unset) | config file (TOML; YAML: .yaml/.yml) of any keys below; "
    config += "``--config`` overrides it |\n"

    def rows(record: type) -> str:
        return "".join(
            f"| ``{env_name(f.name)}`` | {_default_text(f.default)} | {f.metadata['help']} |\n" for f in fields(record)
        )

    engine_intro = (
        "The engine options, the same for the four processes of a tree (each also ``--option`` of ``cdb serve``, "
        "``cdb\nscheduler`` and ``cdb demo``; ``cdb stage`` takes ``--model``, ``--dtype`` and ``--device``):\n\n"
    )
    return head + config + rows(Settings) + "\n" + engine_intro + head + rows(EngineConfig)


if __name__ == "__main__":
    print(variables_table(), end="")
