"""``Settings``: the operational knobs of the stage servers, the scheduler service, the front ends and the launcher,
one frozen record, validated once (each field's ``metadata["help"]`` is its line of the ``CDB_*`` table)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

from cdb_engine.config_source import env_name
from services.settings.checks import SettingsError, value_problem


def _help(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    return field(default=default, metadata={"help": text}, **kw)


SPIN_MIN_CPUS = 8  # ``fence_spin_s`` auto: spin only where the tree's processes leave cores to spare
_SPIN_S = 2e-4
# ``frontends`` auto: a front-end process pays for its link hand-overs only with a core of its own, beside the
# scheduler's engine thread and event loop and the three stages (about four busy cores on a GPU host)
FRONTENDS_MIN_CPUS = 8
FRONTEND_CPUS = 4
MAX_AUTO_FRONTENDS = 4


def usable_cpus() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class Settings:
    """Operational knobs of the stage servers, the scheduler service and the launcher."""

    # --- the stage processes and the scheduler's channels to them
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
    # --- the scheduler service and the tree's processes
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
    # --- the stage plane and the tree's shape: the secret, lost and hung stages, front ends, standbys, rings
    stage_secret: str = _help("the stage plane's shared secret (prefer ``CDB_STAGE_SECRET_FILE``)", "", repr=False)
    stage_secret_file: str = _help("file (mode 0600) holding the stage plane's secret; ``cdb serve`` makes one", "")
    link_secret_file: str = _help("front ends: 0600 file of the link's secret, in place of the stage one's", "")
    link_timeout_s: float = _help("a scheduler silent (a front end not reading) this long: its link is lost, 503s", 5.0)
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
    frontends: int | None = _help(
        "front-end processes (0: the scheduler serves the ports); auto: by the cores and device",
        None,
    )
    standby_stages: bool = _help(
        "a warm standby process per stage role: a lost stage is replaced at once (2x memory)", False
    )
    stage_fork: bool = _help(
        "stages are forked from one process that imported torch (fast starts, restarts; Linux)",
        True,
    )
    stage_rings: bool = _help(
        "stage ops and replies travel on shared-memory rings (x86-64 Linux); false: on gRPC", True
    )
    stage_ring_bytes: int = _help("capacity of each stage ring (two per stage); the largest op or reply fits", 4 << 20)
    cuda_graphs: bool = _help("on CUDA, decode loop ops replay graphs captured per width and context bucket", True)
    # --- the public port: TLS, API keys, per-connection and per-caller limits, timeouts
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
    max_requests_per_caller: int | None = _help(
        "one caller's live requests (by API key, else host); auto: half the capacity", None
    )
    max_streams_per_caller: int | None = _help(
        "open streams of one caller (gRPC, SSE); auto: as max_requests_per_caller", None
    )
    max_health_watches: int = _help("open health Watch streams of all callers (apart from the RPC cap)", 256)
    stream_stall_timeout_s: float = _help(
        "a stream whose client takes no message this long is cut, its request aborted", 60.0
    )
    idle_connection_timeout_s: float = _help("gRPC: a connection without calls this long is closed (GOAWAY)", 300.0)
    http_keep_alive_s: float = _help("HTTP: an idle keep-alive connection is closed after this long", 5.0)
    http_max_connections: int = _help("HTTP: open connections and requests past this get 503 at once", 2048)
    http_max_connections_per_peer: int = _help(
        "HTTP: a client host's connections past this get 429 (proxies: none)", 256
    )
    forwarded_allow_ips: str = _help(
        "HTTP: proxies (IPs, CIDRs; * any) whose X-Forwarded-For names the client",
        "",
    )
    header_read_timeout_s: float = _help(
        "time for a new connection's handshake (gRPC), for a request's headers (HTTP)", 10.0
    )
    body_read_timeout_s: float = _help("HTTP: time for a request's whole body once its headers are in (else 408)", 30.0)
    # --- the OpenAI HTTP API
    http_addr: str = _help("``HOST:PORT`` of the OpenAI HTTP API (``cdb serve``: 127.0.0.1:8000); empty: none", "")
    served_model_name: str = _help("model names the HTTP API accepts, comma-separated; the first is reported", "")
    chat_template: str = _help("HTTP API chat template: a Jinja file or the template; empty: the tokenizer's", "")
    max_request_bytes: int = _help("largest HTTP request body; more: 413 before parsing and the API-key check", 4 << 20)
    # --- measurement
    stage_op_log: str = _help(
        "folder where each stage writes its per-op timeline (``cdb bench hostpath``)",
        "",
    )
    # --- supervision of the tree's children
    restart_limit: int = _help("a child exiting this many times in a row without serving stops the tree (exit 1)", 5)
    restart_backoff_s: float = _help(
        "delay of a child's 2nd restart in a row (the 1st is at once); doubles per restart", 0.5
    )
    restart_backoff_max_s: float = _help("longest delay between two restarts of a failing child", 30.0)
    # --- logs and metrics
    log_level: str = _help("log level of every process of the tree: debug, info, warning or error", "info")
    log_dir: str = _help("folder where each process of a tree writes NAME.log, kept; empty: a temporary one", "")
    log_format: str = _help("log lines as text, or json: one JSON object per line", "text")
    request_log: bool = _help("log a line per finished request: id, caller, tokens, depth, reason, latency", False)
    throughput_log_interval_s: float = _help("period of the scheduler's throughput log line; 0: none", 10.0)
    metrics_vllm_names: bool = _help(
        "also export the main series under vLLM's names (vllm:num_requests_waiting..)", False
    )
    metrics_cache_s: float = _help(
        "a metrics scrape this soon after the last gets its body again (gateways scrape 20/s)", 0.1
    )
    request_latency_buckets: str = _help("bucket bounds (s) of TTFT, end-to-end, queue time; empty: 1 ms..2 h", "")
    token_latency_buckets: str = _help("bucket bounds (s) of inter-token latency and TPOT; empty: 1 ms..60 s", "")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if problem := value_problem(f.name, value):
                raise SettingsError(f"{env_name(f.name)}={value!r}: {problem}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingsError("CDB_TLS_CERT and CDB_TLS_KEY go together: set both or neither")
        if self.link_timeout_s <= 2 * self.health_interval_s:
            raise SettingsError(
                f"CDB_LINK_TIMEOUT_S={self.link_timeout_s} must exceed twice CDB_HEALTH_INTERVAL_S "
                f"({self.health_interval_s}): the scheduler's status frames keep the link alive"
            )
        if self.tls_client_ca and not self.tls_cert:
            raise SettingsError("CDB_TLS_CLIENT_CA needs CDB_TLS_CERT and CDB_TLS_KEY (mTLS is TLS first)")

    @property
    def spin_s(self) -> float:
        """``fence_spin_s`` resolved on this host (auto: spin only where there are cores to spare)."""
        if self.fence_spin_s is not None:
            return self.fence_spin_s
        return _SPIN_S if usable_cpus() >= SPIN_MIN_CPUS else 0.0

    def caller_limits(self, capacity: int) -> tuple[int, int]:
        """``(max_requests_per_caller, max_streams_per_caller)`` for a server admitting ``capacity`` requests at once
        (``max_num_seqs + max_waiting``; auto: half of it, so that one caller cannot hold the server)."""
        auto = max(1, capacity // 2)
        requests = self.max_requests_per_caller if self.max_requests_per_caller is not None else auto
        streams = self.max_streams_per_caller if self.max_streams_per_caller is not None else requests
        return requests, streams

    def front_ends(self, stages_on_device: bool = False) -> int:
        """``frontends`` resolved on this host (auto: where the stages compute on a device, their processes mostly
        wait and a front-end process has a core of its own from two cores on; where they compute on the host's
        cores, none below ``FRONTENDS_MIN_CPUS``; then one per ``FRONTEND_CPUS`` cores beyond four, at most
        ``MAX_AUTO_FRONTENDS``)."""
        if self.frontends is not None:
            return self.frontends
        usable = usable_cpus()
        extra = min(MAX_AUTO_FRONTENDS, max(0, (usable - 4) // FRONTEND_CPUS))
        if stages_on_device:
            return max(1 if usable >= 2 else 0, extra)
        return 0 if usable < FRONTENDS_MIN_CPUS else extra


SETTINGS_FIELDS = tuple(f.name for f in fields(Settings))
