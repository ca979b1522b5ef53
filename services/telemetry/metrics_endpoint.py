"""``GET /metrics`` of a ``Metrics`` from a daemon thread: ``prometheus_client``'s WSGI app (format negotiation,
gzip, ``?name[]=`` filters), and the endpoint's address from ``CDB_METRICS_ADDR``."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import make_wsgi_app

if TYPE_CHECKING:  # (services.telemetry.metrics re-exports this module's server)
    from services.telemetry.metrics import Metrics


MAX_CONNECTIONS = 16  # connections served at once (a thread each); more are closed at once
CONNECTION_TIMEOUT_S = 10.0  # a connection that sends nothing (or trickles its request) for this long is closed


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``MAX_CONNECTIONS`` of them: a scraper needs one or two, and a client that
    opens thousands must not make thousands of threads."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the cap
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S  # (the socket's: a read that waits longer ends the connection)

    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not worth a log line
        pass


def metrics_app(metrics: Metrics) -> Callable[..., Iterable[bytes]]:
    """WSGI app: ``/metrics`` is ``prometheus_client``'s app over ``metrics``; ``/`` and ``/healthz`` a short
    text; anything else 404."""
    exposition = make_wsgi_app(metrics)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return exposition(environ, start_response)
        ok = path in ("/", "/healthz")
        body = b"cdb metrics: see /metrics\n" if ok else b"not found\n"
        status = "200 OK" if ok else "404 Not Found"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]

    return app


class MetricsServer:
    """``GET /metrics`` on a daemon thread. ``port`` is the bound port (useful with port 0)."""

    def __init__(self, metrics: Metrics, host: str = "0.0.0.0", port: int = 9464) -> None:
        self._server = make_server(
            host, port, metrics_app(metrics), server_class=_ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self.host, self.port = host, int(self._server.server_port)
        self._thread = threading.Thread(target=self._server.serve_forever, name="cdb-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(metrics: Metrics, address: str) -> MetricsServer:
    """Serve ``metrics`` on ``address`` = ``"host:port"`` (``":9464"`` means all interfaces)."""
    host, _, port = address.rpartition(":")
    return MetricsServer(metrics, host or "0.0.0.0", int(port))


def metrics_address_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``CDB_METRICS_ADDR`` (e.g. ``0.0.0.0:9464``) as read by ``services.settings``; None when unset or empty (no
    endpoint). Raises ``SettingsError`` when it is not ``HOST:PORT``."""
    from services.settings.source import load_settings

    env = os.environ if environ is None else environ
    return load_settings({k: v for k, v in env.items() if k == "CDB_METRICS_ADDR"}).metrics_addr or None
