"""The HTTP API of a real ``cdb serve`` process tree (for tests through the deployment, once the scheduler serves
``CDB_HTTP_ADDR``): the tree of ``tests.services.tree.process_tree`` with the API on a free loopback port."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from contextlib import contextmanager

from cdb_engine.config import EngineConfig
from services.launcher.supervisor import ServeHandle
from tests.http.harness import wait_until
from tests.services.tree import SHARED_CONFIG, free_port, process_tree


def health_status(host: str, port: int) -> int | None:
    """``GET /health``'s status, or None while nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


@contextmanager
def http_process_tree(config: EngineConfig = SHARED_CONFIG, **env: str) -> Iterator[tuple[ServeHandle, str]]:
    """The tree and the API's base URL (``http://127.0.0.1:PORT/v1``, for ``openai.OpenAI(base_url=...)``), once
    ``/health`` answers 200."""
    port = free_port()
    with process_tree(config, CDB_HTTP_ADDR=f"127.0.0.1:{port}", **env) as handle:
        wait_until(lambda: health_status("127.0.0.1", port) == 200, "the HTTP API to serve", timeout=120, interval=0.05)
        yield handle, f"http://127.0.0.1:{port}/v1"
