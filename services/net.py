"""Addresses and readiness files: the network helpers every process of the tree shares.

- ``is_host_port`` / ``require_loopback`` / ``bound_address``: address checks and the address clients use.
- ``parse_stage_addrs``: ``--stage ROLE=ADDRESS`` options into addresses by stage.
- ``write_ready_file`` / ``wait_ready_file``: a child publishes its bound address once it serves (atomic
  rename); the launcher waits for it and fails fast if the child exits first.
- ``NO_REUSEPORT`` / ``check_can_listen`` / ``listen_on``: gRPC servers listen alone on their port (gRPC's
  default ``SO_REUSEPORT`` lets a second server share a busy port silently); a port that cannot be bound is a
  ``ListenError`` with one line, ``cannot listen on ADDR: address already in use``.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from cdb_scheduler.plan import Stage


def is_host_port(address: str) -> bool:
    """``HOST:PORT`` or ``:PORT`` with a port in 0..65535 (HOST may be empty: all interfaces)."""
    port = address.rpartition(":")[2]
    return ":" in address and port.isdigit() and int(port) < 65536


def require_loopback(listen: str) -> str:
    """Return ``listen`` if it is a Unix socket or a loopback host:port; raise ValueError otherwise."""
    if listen.startswith("unix:"):
        return listen
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address must be unix:PATH or HOST:PORT, got {listen!r}")
    host = host.strip("[]")
    if host == "localhost":
        return listen
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"stage servers listen on loopback or unix sockets only, refusing {listen!r}")
    return listen


def bound_address(listen: str, port: int) -> str:
    """The address clients use: ``listen`` with a port-0 request replaced by the bound port."""
    if listen.startswith("unix:"):
        return listen
    return f"{listen.rpartition(':')[0]}:{port}"


def parse_stage_addrs(specs: Sequence[str], flag: str = "--stage", complete: bool = True) -> dict[Stage, str]:
    """``["prelude=ADDR", "loop=ADDR", "head=ADDR"]`` -> addresses by stage; all three required unless not
    ``complete`` (``--standby-stage``: any roles)."""
    addrs: dict[Stage, str] = {}
    roles = "|".join(s.role for s in Stage)
    for spec in specs:
        role, sep, address = spec.partition("=")
        if not sep or not address or role not in Stage.roles():
            raise ValueError(f"{flag} must be ROLE=ADDRESS with ROLE in {roles}, got {spec!r}")
        addrs[Stage.from_role(role)] = address
    missing = [s.role for s in Stage if s not in addrs]
    if complete and missing:
        raise ValueError(f"missing {flag} for {', '.join(missing)} (or use --in-process)")
    return addrs


def write_ready_file(path: str, address: str) -> None:
    """Publish ``address`` atomically (readers never see a partial file)."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(address)
    os.replace(tmp, path)


class Child(Protocol):
    """What ``wait_ready_file`` asks of a child process (``subprocess.Popen``'s, or a forked stage's)."""

    returncode: int | None

    def poll(self) -> int | None: ...


def wait_ready_file(path: str, proc: Child, timeout: float, what: str) -> str:
    """The address ``proc`` publishes in ``path``; raises RuntimeError if it exits or times out first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f}s")
        time.sleep(0.02)  # polling a file for a child's readiness


# gRPC server option: never share a port with another process (gRPC sets SO_REUSEPORT by default).
NO_REUSEPORT: tuple[tuple[str, int], ...] = (("grpc.so_reuseport", 0),)

_REASONS = {
    errno.EADDRINUSE: "address already in use",
    errno.EACCES: "permission denied",
    errno.EADDRNOTAVAIL: "address not available on this host",
}


class ListenError(OSError):
    """An address cannot be listened on; the message is one line, ``cannot listen on ADDR: REASON``."""


class PortServer(Protocol):
    """What ``listen_on`` needs of a ``grpc.Server`` or ``grpc.aio.Server``."""

    def add_insecure_port(self, address: str) -> int: ...

    def add_secure_port(self, address: str, server_credentials: Any) -> int: ...


def _unix_path(listen: str) -> str:
    rest = listen.removeprefix("unix:")
    return rest[2:] if rest.startswith("//") else rest  # unix:///abs/path or unix:relative/path


def check_can_listen(listen: str) -> None:
    """Raise ``ListenError`` if ``listen`` (``HOST:PORT`` or ``unix:PATH``) is taken or cannot be bound here.

    A probe bind without ``SO_REUSEPORT`` on every address the host resolves to (port 0: nothing to check); for a
    Unix socket, a server answering on its path. Done before gRPC binds, whose own failure also writes a log
    line of the gRPC core to stderr."""
    if listen.startswith("unix:"):
        path = _unix_path(listen)
        if not os.path.exists(path):
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except OSError:
                return  # a stale socket file (gRPC replaces it) or not a socket (gRPC's bind reports it)
        raise ListenError(f"cannot listen on {listen}: address already in use")
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        return
    name = host.strip("[]") or None
    try:
        infos = socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        raise ListenError(f"cannot listen on {listen}: unknown host {host!r}") from None
    for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                reason = _REASONS.get(exc.errno or 0, (exc.strerror or str(exc)).lower())
                raise ListenError(f"cannot listen on {listen}: {reason}") from None


def listen_on(server: PortServer, listen: str, credentials: Any = None, *, check: bool = True) -> int:
    """Add ``listen`` to ``server`` (TLS with ``credentials``, a ``grpc.ServerCredentials``) and return the bound
    port; raise ``ListenError`` if it cannot be bound. Create the server with ``options=NO_REUSEPORT`` (plus
    its own) so that a port held by another process is refused, not shared. ``check=False``: no probe bind (a
    front end joining the others on a shared port)."""
    if check:
        check_can_listen(listen)
    try:
        if credentials is not None:
            port = server.add_secure_port(listen, credentials)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0  # gRPC >= 1.5x raises where older versions returned 0
    if port == 0:
        raise ListenError(f"cannot listen on {listen}: the gRPC server could not bind it")
    return port
