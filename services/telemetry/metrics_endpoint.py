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


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
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
