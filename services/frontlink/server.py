"""``LinkServer``: the scheduler's end of the front-end link (``services.frontlink.wire``).

One thread accepts connections; each admitted front end gets a reader thread (its calls: submit, abort, info,
exposition, observe) and a writer thread. The engine thread never writes to a socket: a request's sink appends the
event to its front end's outbox and wakes the writer only when the outbox was empty, so everything one stage
result produced for that front end leaves in one frame once the engine thread lets go of the interpreter (while it
waits for the next reply). A front end that disconnects has its live requests aborted.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from cdb_api.v1 import generation_pb2 as pb
from cdb_engine.engine import Engine
from cdb_engine.errors import EngineError
from cdb_engine.events import Event, FinishEvent
from services import telemetry
from services.frontlink.messages import (
    Abort,
    AskInfo,
    Call,
    Events,
    LinkError,
    Observe,
    Refusal,
    Reply,
    Status,
    Submit,
    decode_call,
    encode,
)
from services.frontlink.wire import Wire, listen_unix, server_handshake
from services.settings import Settings
from services.telemetry.metrics import Metrics

log = logging.getLogger("cdb.link")
DEPARTURE_WAIT_S = 0.5  # how long a dead front end's link may take to show it is gone (``_release_departed``)


class Shares(Protocol):
    """Per-caller counts (``services.api.shares.CallerShares``); ``take`` raises ``CallerLimit``."""

    def take(self, scope: str, streaming: bool) -> None: ...

    def give_back(self, scope: str, streaming: bool) -> None: ...


class Door(Protocol):
    """What the link uses of the scheduler's front door (``services.api.door.FrontDoor``)."""

    settings: Settings
    metrics: Metrics
    traces: telemetry.RequestTraces | None

    @property
    def shares(self) -> Shares:
        """Every front end's requests count in it."""
        ...

    def verdict(self) -> str | None: ...


# the request metrics a front end records (``ObservedRequest``) and the scheduler's registry takes from it
OBSERVATIONS = frozenset(
    {
        "observe_rejected",
        "observe_admitted",
        "observe_itls",  # a front end sends its per-token observations as lists
        "observe_ttft",
        "observe_token_depths",
        "observe_queue_time",
        "observe_request_end",
        "observe_request_tokens",
    }
)


class _Peer:
    """One connected front end: its outbox, its live requests, its writer thread."""

    def __init__(
        self, wire: Wire, name: str, reason: Callable[[], str | None], stats: Callable[[], Any], interval_s: float
    ) -> None:
        self.wire = wire
        self.name = name
        # engine ids of its requests that have not finished, with the share each holds of its caller (under ``_cond``)
        self.live: dict[str, _Share] = {}
        self._reason, self._stats = reason, stats
        self._interval_s = interval_s
        self._status_due = 0.0
        self._last_reason: str | None = None
        self._cond = threading.Condition()
        self._events: list[Event] = []
        self._replies: list[Reply] = []
        self._closed = False
        self._departed = False
        self.admitting = threading.Lock()  # its submissions and its departure, one at a time
        self._writer = threading.Thread(target=self._write, name=f"cdb-link-out-{name}", daemon=True)

    def start(self) -> None:
        """Start writing (its first frame is the status that tells the front end it is ready)."""
        self._writer.start()

    def track(self, key: str, share: _Share) -> bool:
        """Count ``key`` as its live request, holding ``share`` (taken here; ``CallerLimit`` raised, nothing
        counted); False once it has left."""
        with self._cond:
            if self._departed:
                return False
            share.take()
            self.live[key] = share
            return True

    def untrack(self, key: str, share: _Share) -> None:
        """A submission under ``key`` failed: it holds nothing."""
        with self._cond:
            if self.live.get(key) is share:
                del self.live[key]
        share.give_back()

    def holds(self, key: str) -> bool:
        with self._cond:
            return key in self.live

    def leave(self) -> list[str] | None:
        """It is gone: its requests that have not finished, to be aborted (their shares given back now: a client
        resuming them elsewhere is not refused for its own share); None if it had left already."""
        with self._cond:
            if self._departed:
                return None
            self._departed = True
            live, self.live = self.live, {}
        for share in live.values():
            share.give_back()
        return list(live)

    def post(self, key: str, event: Event, share: _Share) -> None:
        """The engine thread: ``event`` of request ``key`` (holding ``share``) for this front end; its finish gives
        the share back (that request's own: an id reused after an abort is another request's)."""
        finished = isinstance(event, FinishEvent)
        with self._cond:
            if finished and self.live.get(key) is share:
                del self.live[key]
            self._events.append(event)  # its request_id is the engine's id, ``key``
            if len(self._events) == 1:
                self._cond.notify()
        if finished:
            share.give_back()

    def reply(self, message: Reply) -> None:
        if not message.cid:
            return
        with self._cond:
            self._replies.append(message)
            self._cond.notify()

    def _write(self) -> None:
        try:
            self._send_status(force=True)
            while True:
                with self._cond:
                    if not (self._events or self._replies or self._closed):
                        self._cond.wait(self._interval_s)
                    if self._closed:
                        return
                    events, self._events = self._events, []
                    replies, self._replies = self._replies, []
                for reply in replies:  # an ack before the events of its request's first result
                    self.wire.send(encode(reply))
                if events:
                    self.wire.send(encode(Events.of(events)))
                self._send_status()
        except (OSError, LinkError):
            self.close()  # the reader sees the socket end and releases the requests

    def _send_status(self, force: bool = False) -> None:
        """The readiness verdict when it changes, with the engine's counters at least every interval."""
        now, reason = time.monotonic(), self._reason()
        if not force and now < self._status_due and reason == self._last_reason:
            return
        self._last_reason, self._status_due = reason, now + self._interval_s
        self.wire.send(encode(Status(reason, self._stats())))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self.wire.close()


class _Share:
    """The share one submitted request holds of its caller in the scheduler's count: taken when its front end
    tracks it, given back once, by whichever comes first: its finish, its front end's departure (at once: a client
    resuming it elsewhere is not refused for its own share), or a failed submission."""

    __slots__ = ("_lock", "caller", "held", "shares", "streaming")

    def __init__(self, shares: Shares, caller: str, streaming: bool) -> None:
        self.shares, self.caller, self.streaming = shares, caller, streaming
        self.held = False
        self._lock = threading.Lock()  # (the engine thread's finish and a reader's departure may race)

    def take(self) -> None:
        if self.caller:
            self.shares.take(self.caller, self.streaming)  # (``CallerLimit``: refused, nothing held)
            self.held = True

    def give_back(self) -> None:
        with self._lock:
            held, self.held = self.held, False
        if held:
            self.shares.give_back(self.caller, self.streaming)


class LinkServer:
    """Serve the front-end link on ``path`` for ``engine`` (``door``: the readiness verdict, and the registry that
    takes the front ends' observations; ``info``: the ``Info`` reply)."""

    def __init__(self, path: str, engine: Engine, door: Door, info: Callable[[], pb.InfoResponse], secret: str) -> None:
        self.path = path
        self.engine = engine
        self.door = door
        self.info = info
        self._secret = secret.encode()
        self._sock: socket.socket | None = None
        self._peers: set[_Peer] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._count = 0

    def start(self) -> LinkServer:
        self._sock = listen_unix(self.path)
        threading.Thread(target=self._accept, name="cdb-link-accept", daemon=True).start()
        log.info("front-end link on unix:%s", self.path)
        return self

    @property
    def live(self) -> int:
        """Requests of connected front ends that have not finished."""
        with self._lock:
            return sum(len(peer.live) for peer in self._peers)

    @property
    def peers(self) -> int:
        with self._lock:
            return len(self._peers)

    def reason(self) -> str | None:
        """The readiness verdict front ends serve by (None: ready)."""
        return self.door.verdict()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._count += 1
            name = f"fe{self._count}"
            threading.Thread(target=self._serve, args=(conn, name), name=f"cdb-link-in-{name}", daemon=True).start()

    def _serve(self, conn: socket.socket, name: str) -> None:
        wire = Wire(conn)
        try:
            server_handshake(wire, self._secret)
        except (OSError, LinkError) as exc:
            log.warning("front-end link: refused a connection: %s", exc)
            wire.close()
            return
        settings = self.door.settings
        # a front end that reads nothing this long (stopped, frozen) is dropped: its writer never blocks for longer
        timeout = struct.pack("ll", int(settings.link_timeout_s), int(settings.link_timeout_s % 1 * 1e6))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
        peer = _Peer(wire, name, self.reason, self.engine.stats, settings.health_interval_s)
        with self._lock:
            self._peers.add(peer)
        peer.start()  # (counted before it can hear it is ready)
        log.info("front end %s connected", name)
        try:
            while True:
                self._handle(peer, decode_call(wire.recv()))
        except (OSError, LinkError, EOFError):
            pass
        except Exception:  # a frame it may not send: drop the connection, keep serving the others
            log.exception("front end %s sent a bad frame; closing its link", name)
        finally:
            self._depart(peer)

    def _depart(self, peer: _Peer) -> None:
        """``peer`` is gone: close its link and abort its live requests, once (when its reader sees the link end, or
        earlier, when another front end submits an id it still holds)."""
        peer.close()
        with peer.admitting:  # (a submission its reader is making finishes first: then it is aborted too)
            left = peer.leave()
            if left is None:
                return
            for key in left:
                self.engine.abort(key)
        log.info("front end %s disconnected%s", peer.name, f"; aborted its {len(left)} live requests" if left else "")
        with self._lock:  # last: ``peers`` counts it until its requests are aborted
            self._peers.discard(peer)

    def _release_departed(self, peer: _Peer, key: str) -> None:
        """A client resumes a stream on ``peer`` with the id it had on a front end that died, before the dead one's
        reader has read the end of its link (or before the kernel has closed that link: a dying process's sockets
        close one by one). The dead front end's requests are aborted first, so its id is free (and its slot and
        blocks too). A holder gets ``DEPARTURE_WAIT_S`` to show it is gone; a live front end holding the id makes
        the submission wait that long before it is refused as a duplicate."""
        with self._lock:
            holders = [p for p in self._peers if p is not peer and p.holds(key)]
        for other in holders:
            if other.wire.peer_gone(DEPARTURE_WAIT_S):
                self._depart(other)

    def _handle(self, peer: _Peer, msg: Call) -> None:
        if isinstance(msg, Observe):
            metrics = self.door.metrics
            for method, args in msg.calls:
                if method in OBSERVATIONS:
                    getattr(metrics, method)(*args)
            return
        value: Any = None
        try:
            if isinstance(msg, Submit):
                self._submit(peer, msg)
            elif isinstance(msg, Abort):
                value = self.engine.abort(msg.key, msg.reason)
            elif isinstance(msg, AskInfo):
                value = self.info().SerializeToString()
            else:
                value = self.door.metrics.exposition(msg.accept)
        except EngineError as exc:
            peer.reply(Reply(msg.cid, Refusal.of(exc)))
        else:
            peer.reply(Reply(msg.cid, None, value))

    def _submit(self, peer: _Peer, msg: Submit) -> None:
        key, params, traceparent = msg.key, msg.params, msg.traceparent
        span = None
        if traceparent and telemetry.enabled():  # the stage hops of a traced request, under the front end's span
            span = telemetry.start_request_span(
                model=self.engine.config.model,
                max_tokens=params.max_tokens,
                metadata=(("traceparent", traceparent),),
                operation="engine",  # no request id: the front end's span is the request's (SERVER) span
            )
        traces = self.door.traces
        share = _Share(self.door.shares, msg.caller, msg.streaming)

        def queued(rid: int) -> None:
            if traces is not None and span is not None:
                traces.register(rid, span)
                span.enqueued()

        def sink(event: Event) -> None:
            peer.post(key, event, share)
            if span is not None and isinstance(event, FinishEvent):
                span.finish(event.finish_reason, event.generated_tokens, (), event.total_loop_steps)

        self._release_departed(peer, key)
        with peer.admitting:
            if not peer.track(key, share):
                raise LinkError(f"front end {peer.name} has left")
            try:
                self.engine.submit(msg.ids, params, sink, key, on_queued=queued, detokenize=False)  # (text: front end)
            except BaseException:
                peer.untrack(key, share)
                if span is not None:
                    span.finish("error", 0)
                raise

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.close()
