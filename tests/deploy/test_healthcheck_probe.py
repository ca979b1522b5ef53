"""The grpc health probe used by compose healthchecks, against a real health server on loopback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import healthcheck

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_check_statuses(health_server: tuple[str, health.HealthServicer]) -> None:
    addr, servicer = health_server
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    servicer.set("", serving)
    servicer.set("cdb.v1.Generation", not_serving)
    assert healthcheck.check(addr) == "SERVING"
    assert healthcheck.check(addr, "cdb.v1.Generation") == "NOT_SERVING"
    assert healthcheck.check(addr, "no.such.Service") == "NOT_FOUND"
    assert healthcheck.main([addr, "-q"]) == 0
    assert healthcheck.main([addr, "cdb.v1.Generation", "-q"]) == 1


def test_unreachable_is_not_ready() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert healthcheck.check(f"127.0.0.1:{port}", timeout=0.5) in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert healthcheck.main([f"127.0.0.1:{port}", "-q", "--timeout", "0.5"]) == 1


def test_module_entrypoint(health_server: tuple[str, health.HealthServicer]) -> None:
    """Exactly how compose runs it: ``python -m services.healthcheck ADDR``."""
    addr, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    run = subprocess.run(
        [sys.executable, "-m", "services.healthcheck", addr], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"{addr} <server>: SERVING"
