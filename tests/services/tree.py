"""The real process tree (three stage servers + the scheduler service) on loopback, for integration tests."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from cdb_bench.processes import free_port
from cdb_engine.config import EngineConfig
from clients.messages import GenerateOptions, StreamFinish, StreamToken
from clients.resume import RESUME_ATTEMPTS
from clients.sync_client import Client
from services.launcher.supervisor import ServeHandle
from services.launcher.tree import serve_all
from services.telemetry.otlp_receiver import OtlpReceiver

# Faster readiness transitions than production defaults, so failures show up quickly in tests; and no HTTP API
# unless a test asks for one on a free port (``tests.http.tree``): trees started at once never race for one port.
TEST_ENV = {
    "CDB_HEALTH_INTERVAL_S": "0.1",
    "CDB_STAGE_KEEPALIVE_S": "2",
    "CDB_STAGE_PROBE_TIMEOUT_S": "1",
    "CDB_HTTP_ADDR": "",
    # every test's client is the one host, and some fill the server from it (the default, half of the server per
    # caller, is tested in tests/services/test_fair_shares.py and over two front ends in test_frontends_tree.py)
    "CDB_MAX_REQUESTS_PER_CALLER": "1024",
}

# The tree shared by every test that neither kills, stops nor reconfigures it (``ouro_tiny_tree`` in
# tests/conftest.py). float64, so its tokens equal an in-process engine's exactly whatever the batching.
SHARED_CONFIG = EngineConfig(
    model="ouro-tiny",
    dtype="float64",
    max_num_seqs=8,
    num_kv_blocks=512,
    max_input_tokens=200,
    max_total_tokens=400,
    max_waiting=64,
)

HELD = ("waiting", "running", "held_rows", "used_kv_blocks")
IDLE = dict.fromkeys(HELD, 0)


@contextmanager
def process_tree(config: EngineConfig, **env: str) -> Iterator[ServeHandle]:
    """Start the tree on ``127.0.0.1:0``; stop it (and every child) on exit."""
    handle = serve_all(config, "127.0.0.1:0", env={**os.environ, **TEST_ENV, **env})
    try:
        yield handle
    finally:
        handle.stop(drain_timeout=5.0)


@dataclass(frozen=True)
class SharedTree:
    """A running tree that exports its spans to ``receiver`` and serves Prometheus metrics at ``metrics_url``."""

    handle: ServeHandle
    receiver: OtlpReceiver
    metrics_url: str
    config: EngineConfig = SHARED_CONFIG

    @property
    def address(self) -> str:
        return self.handle.address


@contextmanager
def traced_process_tree(config: EngineConfig = SHARED_CONFIG) -> Iterator[SharedTree]:
    """A tree with tracing on (every process exports to an in-process OTLP receiver) and a metrics endpoint."""
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "CDB_METRICS_ADDR"}
        env.update(TEST_ENV)
        env.update(
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        metrics = f"127.0.0.1:{free_port()}"
        handle = serve_all(config, "127.0.0.1:0", env=env, metrics_listen=metrics)
        try:
            yield SharedTree(handle, receiver, f"http://{metrics}/metrics", config)
        finally:
            handle.stop(drain_timeout=5.0)


def wait_for_counters(
    client: Client, done: Callable[[dict[str, int]], bool], what: str, timeout: float = 20.0
) -> dict[str, int]:
    """Poll ``Info`` until ``done(counters)``; return those counters. For states the server exposes only through
    ``Info`` (queue lengths, held rows and blocks), where there is no event to wait on. Raises AssertionError
    naming ``what`` and the last counters seen after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done(counters := client.info().counters):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout}s; last counters {counters}")
        time.sleep(0.02)  # the poll interval
    return counters


def wait_idle(client: Client, timeout: float = 20.0) -> dict[str, int]:
    """Wait until nothing is waiting, running or held (aborts and cancels are applied asynchronously); return
    those counters (all zero), or the last ones seen after ``timeout`` seconds."""
    try:
        counters = wait_for_counters(client, lambda c: not any(c[k] for k in HELD), "idle", timeout)
    except AssertionError:
        counters = client.info().counters
    return {k: counters[k] for k in HELD}


@dataclass
class StreamRun:
    """A stream consumed on its own thread: ``first`` is set at the first token, ``done`` at the end."""

    client: Client
    prompt: str | Sequence[int]
    options: GenerateOptions
    timeout: float | None = None
    resume_attempts: int = RESUME_ATTEMPTS  # 0: a broken stream's error reaches the test (server semantics)
    tokens: list[StreamToken] = field(default_factory=list)
    finish: StreamFinish | None = None
    error: grpc.RpcError | None = None
    first: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> StreamRun:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            stream = self.client.stream(
                self.prompt, timeout=self.timeout, resume_attempts=self.resume_attempts, **self.options
            )
            for item in stream:
                if isinstance(item, StreamToken):
                    self.tokens.append(item)
                    self.first.set()
                else:
                    self.finish = item
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.first.set()
            self.done.set()

    @property
    def code(self) -> grpc.StatusCode | None:
        return self.error.code() if self.error is not None else None
