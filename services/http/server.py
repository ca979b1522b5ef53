"""uvicorn serving an app on the running event loop, without uvicorn's signal handlers (the serving process owns
SIGTERM and drains): ``HttpServer`` and ``serve_http``. Stopping closes the listener, lets in-flight responses end
for up to ``shutdown_timeout_s`` and then cuts them (which aborts their requests)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from services.http.protocol import PeerConnections, guarded_protocol
from services.settings import Settings

log = logging.getLogger("cdb.http")


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: in the scheduler SIGTERM means drain, which the scheduler does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(address: str, reuse_port: bool = False) -> socket.socket:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, int(port)), family=family, dualstack_ipv6=False, reuse_port=reuse_port)
    sock.setblocking(False)
    return sock


def _tls_options(settings: Settings) -> dict[str, Any]:
    """The public port's TLS (``CDB_TLS_CERT`` / ``CDB_TLS_KEY``; ``CDB_TLS_CLIENT_CA``: client certificates)."""
    if not settings.tls_cert:
        return {}
    out: dict[str, Any] = {"ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
    if settings.tls_client_ca:
        out.update(ssl_ca_certs=settings.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return out


class HttpServer:
    """uvicorn serving ``app`` on ``address`` (``HOST:PORT``; port 0: any free port). The socket is bound and
    listening at construction, so ``address`` (the bound one) is known at once and connections queue until
    ``serve`` accepts them."""

    def __init__(
        self,
        app: FastAPI,
        address: str,
        *,
        settings: Settings | None = None,
        shutdown_timeout_s: float = 5.0,
        reuse_port: bool = False,
    ) -> None:
        self.socket = _listen(address, reuse_port)
        host, port = address.rpartition(":")[0] or "0.0.0.0", self.socket.getsockname()[1]
        self.address = f"{host}:{port}"
        self.scheme = "https" if settings is not None and settings.tls_cert else "http"
        limits = settings or Settings()
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            ws="none",
            http=guarded_protocol(
                limits.header_read_timeout_s,
                limits.stream_stall_timeout_s,
                PeerConnections(limits.http_max_connections_per_peer, limits.forwarded_allow_ips),
            ),
            timeout_keep_alive=limits.http_keep_alive_s,  # type: ignore[arg-type]  # a float works (call_later)
            limit_concurrency=limits.http_max_connections,
            # the client's address names its caller (its share): a forwarded one only from a configured proxy
            proxy_headers=bool(limits.forwarded_allow_ips),
            forwarded_allow_ips=limits.forwarded_allow_ips or None,
            timeout_graceful_shutdown=max(1, round(shutdown_timeout_s)),
            **(_tls_options(settings) if settings is not None else {}),
        )
        self._server = _Server(config)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"

    async def serve(self) -> None:
        """Serve until ``stop()`` (or cancellation, which stops gracefully first and then re-raises)."""
        task = asyncio.ensure_future(self._server.serve(sockets=[self.socket]))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            self.stop()
            await task
            raise

    def stop(self) -> None:
        """Begin the graceful stop (``serve`` returns once it is done)."""
        self._server.should_exit = True


async def serve_http(
    app: FastAPI,
    address: str,
    *,
    settings: Settings | None = None,
    shutdown_timeout_s: float = 5.0,
    on_bound: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    reuse_port: bool = False,
) -> None:
    """Serve ``app`` on ``address`` until ``stop`` is set or the task is cancelled; ``on_bound(HOST:PORT)`` once the
    socket listens. Either way the listener closes first and in-flight responses get ``shutdown_timeout_s``.
    ``reuse_port``: front-end processes share the port (``SO_REUSEPORT``)."""
    server = HttpServer(app, address, settings=settings, shutdown_timeout_s=shutdown_timeout_s, reuse_port=reuse_port)
    log.info("OpenAI-compatible HTTP API on %s", server.url)
    if on_bound is not None:
        on_bound(server.address)
    serving = asyncio.ensure_future(server.serve())
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        await asyncio.wait([t for t in (serving, stopping) if t is not None], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if stopping is not None:
            stopping.cancel()
        if not serving.done():
            server.stop()
        await serving
