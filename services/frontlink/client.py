"""A front end's view of the engine in the scheduler process: ``LinkClient`` (the connection), ``RemoteClient``
(the ``EngineClient`` the front door uses) and ``MetricsRelay`` (request metrics sent to the scheduler).

The front door (``services.api.door``) runs unchanged over a ``RemoteClient``: requests are prepared here
(``RequestPreparer``: the model's config, tokenizer and limits, no engine), submitted over the link with the
scheduler's acknowledgement awaited (so a refusal, a full queue or a duplicate id is raised before anything is
streamed, as in-process), and each request's events are handed to its ``RequestStream`` from the link's reader
thread, one event-loop wake-up per frame.

Text is made here, not in the scheduler process: the scheduler sends token ids (``Engine.submit(detokenize=
False)``) and each request's ``TextOutput`` runs on the link's reader thread, the same rule the engine runs. A stop
string found here ends the stream at once and asks the scheduler to end the request with ``FinishReason.STOP``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from cdb_engine.config import RequestParams
from cdb_engine.errors import EngineStopped, InvalidRequest
from cdb_engine.events import EngineStats, FinishEvent, RequestObserver
from cdb_engine.prepare import RequestPreparer
from cdb_engine.stream import RequestStream
from cdb_scheduler.request import FinishReason
from services.frontlink.wire import (
    LinkError,
    Wire,
    client_handshake,
    connect_unix,
    dumps,
    loads,
    raise_error,
)

log = logging.getLogger("cdb.frontend")

_RECONNECT_S = 0.2
_FLUSH_S = 0.05  # request metrics reach the scheduler's registry within this


def _down_stats(reason: str) -> EngineStats:
    return EngineStats(0, 0, 0, 0, 0, 0, 0, time.monotonic(), False, reason)


class LinkClient:
    """The front end's connection to the scheduler's link: connects (and reconnects) on its own thread, reads
    frames on another. ``streams``: the live requests of this front end by engine id."""

    def __init__(self, path: str, secret: str) -> None:
        self.path = path
        self._secret = secret.encode()
        self.streams: dict[str, RequestStream] = {}
        self.reason: str | None = "connecting to the scheduler"  # the verdict to serve by (None: ready)
        self.stats = _down_stats(self.reason)
        self.connected = threading.Event()
        self._wire: Wire | None = None
        self._calls: dict[int, Future[Any]] = {}
        self._cids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="cdb-link", daemon=True)

    def start(self) -> LinkClient:
        self._thread.start()
        return self

    # --- calls -------------------------------------------------------------------------------------------------
    def send(self, message: tuple[Any, ...]) -> None:
        """Send a frame that wants no answer; raises ``EngineStopped`` when the link is down."""
        wire = self._wire
        if wire is None:
            raise EngineStopped(self.reason or "the scheduler link is down")
        try:
            wire.send(dumps(message))
        except OSError as exc:
            raise EngineStopped(f"the scheduler link is down ({exc})") from None

    def call(self, kind: str, *args: Any) -> Future[Any]:
        """Send a call; its answer (or the engine error it raised) completes the returned future."""
        fut: Future[Any] = Future()
        cid = next(self._cids)
        with self._lock:
            self._calls[cid] = fut
        try:
            self.send((kind, cid, *args))
        except EngineStopped as exc:
            with self._lock:
                self._calls.pop(cid, None)
            fut.set_exception(exc)
        return fut

    async def ask(self, kind: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self.call(kind, *args))

    # --- the connection ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            try:
                wire = Wire(connect_unix(self.path))
            except OSError:
                time.sleep(_RECONNECT_S)  # the scheduler is starting, or being restarted
                continue
            try:
                client_handshake(wire, self._secret)
            except (OSError, LinkError) as exc:
                log.error("front-end link: %s", exc)
                wire.close()
                time.sleep(_RECONNECT_S)
                continue
            self._wire = wire
            self.connected.set()
            log.info("connected to the scheduler (unix:%s)", self.path)
            why = "the scheduler closed the link"
            try:
                while True:
                    self._on_frame(loads(wire.recv()))
            except (OSError, LinkError, EOFError) as exc:
                why = f"the scheduler link was lost ({exc})"
            finally:
                self._wire = None
                self.connected.clear()
                wire.close()
                self._lost(why)

    def _on_frame(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "events":
            streams = self.streams
            for event in msg[1]:
                key = event.request_id
                stream = streams.get(key)
                if stream is None:
                    continue  # its consumer left and aborted it
                out = stream.text
                assert out is not None  # (this side makes the text of every request it submitted)
                if isinstance(event, FinishEvent):
                    del streams[key]
                    stream.sink(out.finish(event))
                elif (text := out.text(event.token_id, event.depth)) is not None:
                    event.text = text  # (an unpickled event: this front end's own)
                    stream.sink(event)
                    if out.stopped:
                        with contextlib.suppress(EngineStopped):  # (a link that is down has ended it already)
                            self.send(("abort", 0, key, FinishReason.STOP))
        elif kind == "reply":
            _, cid, err, value = msg
            with self._lock:
                fut = self._calls.pop(cid, None)
            if fut is None:
                return
            if err is None:
                fut.set_result(value)
            else:
                try:
                    raise_error(err)
                except Exception as exc:
                    fut.set_exception(exc)
        elif kind == "status":
            _, self.reason, self.stats = msg

    def _lost(self, why: str) -> None:
        """The scheduler is gone: its requests cannot go on; every live one ends with an error."""
        self.reason = why
        self.stats = _down_stats(why)
        if self._closed:
            return
        log.warning("%s; failing %d live requests, reconnecting", why, len(self.streams))
        with self._lock:
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            fut.set_exception(EngineStopped(why))
        streams, self.streams = self.streams, {}
        for key, stream in streams.items():
            stream.sink(FinishEvent(key, FinishReason.ERROR, 0, 0, 0, error=why))

    def close(self) -> None:
        self._closed = True
        wire = self._wire
        if wire is not None:
            wire.close()


class RemoteClient:
    """``EngineClient`` for the engine in the scheduler process behind ``link``."""

    def __init__(self, prep: RequestPreparer, link: LinkClient) -> None:
        self._prep = prep
        self.link = link

    @property
    def prep(self) -> RequestPreparer:
        return self._prep

    def stats(self) -> EngineStats:
        return self.link.stats

    def health(self) -> str | None:
        """The scheduler's verdict as its last status frame carried it, or why the link is down."""
        return self.link.reason

    async def open_stream(
        self,
        prompt_ids: Sequence[int],
        params: RequestParams,
        request_id: str,
        *,
        observer: RequestObserver | None = None,
    ) -> RequestStream:
        if not request_id:
            raise InvalidRequest("request_id", "a front end submits requests under their ids")
        link = self.link
        if request_id in link.streams:
            raise InvalidRequest("request_id", f"{request_id!r} is already used by a live request")
        stream = RequestStream(lambda: self._abort_own(request_id), observer, self._prep.output(params))
        stream.request_id = request_id
        link.streams[request_id] = stream  # before the submit: events may come with the ack
        span = getattr(observer, "span", None)
        traceparent = span.traceparent if span is not None and span.recording else ""
        try:
            await link.ask("submit", request_id, list(prompt_ids), params, traceparent)
        except BaseException:
            if link.streams.get(request_id) is stream:
                del link.streams[request_id]
            raise
        return stream

    def _abort_own(self, request_id: str) -> None:
        with contextlib.suppress(EngineStopped):  # the link is down: the scheduler has aborted it already
            self.link.send(("abort", 0, request_id))

    async def abort(self, request_id: str) -> bool:
        """End a request: one of this front end's at once (True); another's by asking the scheduler."""
        if self.link.streams.get(request_id) is not None:
            self._abort_own(request_id)
            return True
        found: bool = await self.link.ask("abort", request_id)
        return found


class MetricsRelay:
    """The request metrics of a front end (the ``observe_*`` calls ``ObservedRequest`` makes), sent to the
    scheduler's registry in one frame every ``_FLUSH_S``, the per-token ones as two lists (applied there with one
    update per histogram bucket hit); ``exposition`` is the scheduler's."""

    def __init__(self, link: LinkClient) -> None:
        self.link = link
        self._calls: list[tuple[str, tuple[Any, ...]]] = []
        self._itls: list[float] = []
        self._depths: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cdb-metrics-relay", daemon=True)
        self._thread.start()

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self._itls.append(seconds)

    def observe_token_depth(self, depth: int) -> None:
        with self._lock:
            self._depths.append(depth)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("observe_"):
            raise AttributeError(name)

        def record(*args: Any) -> None:  # per request, not per token
            with self._lock:
                self._calls.append((name, args))

        return record

    async def exposition(self, accept: str | None) -> tuple[bytes, str]:
        body, content_type = await self.link.ask("exposition", accept)
        return body, content_type

    def flush(self) -> None:
        with self._lock:
            buf, self._calls = self._calls, []
            itls, self._itls = self._itls, []
            depths, self._depths = self._depths, []
        if itls:
            buf.append(("observe_itls", (itls,)))
        if depths:
            buf.append(("observe_token_depths", (depths,)))
        if buf:
            with contextlib.suppress(EngineStopped):  # the scheduler is gone, and its registry with it
                self.link.send(("observe", buf))

    def _run(self) -> None:
        while not self._stop.wait(_FLUSH_S):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self.flush()
