"""The real process tree (three stage servers + the scheduler service) on loopback, for integration tests."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from cdb_engine.config import EngineConfig
from clients.common import GenerateOptions, StreamFinish, StreamToken
from clients.sync_client import Client
from services.launcher import ServeHandle, serve_all

# Faster readiness transitions than production defaults, so failures show up quickly in tests.
TEST_ENV = {"CDB_HEALTH_INTERVAL_S": "0.1", "CDB_STAGE_KEEPALIVE_S": "2", "CDB_STAGE_PROBE_TIMEOUT_S": "1"}


@contextmanager
def process_tree(config: EngineConfig, **env: str) -> Iterator[ServeHandle]:
    """Start the tree on ``127.0.0.1:0``; stop it (and every child) on exit."""
    handle = serve_all(config, "127.0.0.1:0", env={**os.environ, **TEST_ENV, **env})
    try:
        yield handle
    finally:
        handle.stop(drain_timeout=5.0)


@dataclass
class StreamRun:
    """A stream consumed on its own thread: ``first`` is set at the first token, ``done`` at the end."""

    client: Client
    prompt: str | Sequence[int]
    options: GenerateOptions
    timeout: float | None = None
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
            for item in self.client.stream(self.prompt, timeout=self.timeout, **self.options):
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
