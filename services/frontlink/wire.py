"""The link between the scheduler process and its front-end processes (``CDB_FRONTENDS``, ``cdb frontend``).

With front-end processes the public ports (gRPC, HTTP) live in them, and the scheduler process keeps only the
engine (planning, the stage plane) and the metrics endpoint: streaming a token over gRPC costs a front end tens of
microseconds of CPU, which no longer competes with the planner for its interpreter, and streaming capacity grows
with the number of front ends. Each front end holds one connection to the scheduler's link socket (a Unix socket in
the tree's private directory):

- front end -> scheduler: ``Submit`` (a validated request: scoped id, prompt ids, ``RequestParams``, the request
  span's traceparent), ``Abort``, ``AskInfo`` and ``AskExposition`` (the replies of ``Info`` and ``/metrics``), and
  ``Observe`` (the request metrics the front end recorded since its last batch: the scheduler's registry stays
  the only one). A call that wants an answer carries a call id; the answer comes back as a ``Reply``.
- scheduler -> front end: ``Events`` (every event of every request of that front end that one engine hand-over
  produced: one frame per stage result, not one per token), ``Reply``, and ``Status`` (the readiness verdict and
  the engine's counters, on change and every health interval).

Frames are length-prefixed MessagePack of the typed messages of ``services.frontlink.messages``, decoded against
their types: a peer can send no code. A connection is admitted by a challenge over the deployment's stage secret
(HMAC-SHA256 both ways) before any frame is read. A front end that goes away has its live requests aborted (their
slots and KV blocks freed); a scheduler that goes away ends the front end's live requests with an error, and the
front end reconnects when it comes back.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import threading

from services.frontlink.messages import LinkError

log = logging.getLogger("cdb.link")

_LEN = struct.Struct("<I")
MAX_FRAME = 256 << 20  # a frame longer than this is a broken peer, not a message
_HANDSHAKE_S = 5.0
_NONCE = 32


class Wire:
    """Length-prefixed frames on a connected stream socket: ``send`` from any thread, ``recv`` from one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, payload: bytes) -> None:
        with self._lock:
            self.sock.sendall(_LEN.pack(len(payload)) + payload)

    def recv(self) -> bytes:
        (n,) = _LEN.unpack(self._exact(_LEN.size))
        if n > MAX_FRAME:
            raise LinkError(f"a frame of {n} bytes (at most {MAX_FRAME})")
        return self._exact(n)

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise LinkError("the link's peer closed it")
            got += k
        return bytes(buf)

    def peer_gone(self, wait_s: float = 0.0) -> bool:
        """Whether the peer has closed its end (or the connection broke), even with frames still unread: a process
        that died has had its sockets closed by the kernel before anyone could see it was gone. ``wait_s``: how long
        to wait for it (a dying process's sockets close one by one, this one maybe after those its clients saw)."""
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            return bool(poller.poll(int(wait_s * 1000)))
        except (OSError, ValueError):  # closed here already
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def server_handshake(wire: Wire, secret: bytes) -> None:
    """Admit a connecting front end: it proves the secret on our nonce, we prove it on its nonce."""
    wire.sock.settimeout(_HANDSHAKE_S)
    ours = secrets.token_bytes(_NONCE)
    wire.send(ours)
    answer = wire.recv()
    if len(answer) != 32 + _NONCE or not hmac.compare_digest(answer[:32], _mac(secret, b"front", ours)):
        raise LinkError("a front end failed the link handshake (wrong stage secret)")
    wire.send(_mac(secret, b"sched", answer[32:]))
    wire.sock.settimeout(None)


def client_handshake(wire: Wire, secret: bytes) -> None:
    wire.sock.settimeout(_HANDSHAKE_S)
    theirs = wire.recv()
    ours = secrets.token_bytes(_NONCE)
    wire.send(_mac(secret, b"front", theirs) + ours)
    if not hmac.compare_digest(wire.recv(), _mac(secret, b"sched", ours)):
        raise LinkError("the scheduler failed the link handshake (wrong stage secret)")
    wire.sock.settimeout(None)


def socket_path(address: str) -> str:
    """The filesystem path of a link address (``unix:PATH``, ``unix://PATH`` or a bare path)."""
    path = address.removeprefix("unix://").removeprefix("unix:")
    if not path:
        raise ValueError(f"link address {address!r}: expected unix:PATH")
    return path


def listen_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` (a stale one replaced), readable by this user only."""
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


def connect_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock
