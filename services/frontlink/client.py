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
from services.frontlink.messages import (
    Abort,
    AskExposition,
    AskInfo,
    Call,
    Events,
    LinkError,
    News,
    Observe,
    Reply,
    Submit,
    decode_news,
    encode,
)
from services.frontlink.wire import Wire, client_handshake, connect_unix

Asking = Submit | Abort | AskInfo | AskExposition  # the calls that want an answer

log = logging.getLogger("cdb.frontend")

_RECONNECT_S = 0.2
_FLUSH_S = 0.05  # request metrics reach the scheduler's registry within this


def _down_stats(reason: str) -> EngineStats:
    return EngineStats(0, 0, 0, 0, 0, 0, 0, time.monotonic(), False, reason)


class LinkClient:
    """The front end's connection to the scheduler's link: connects (and reconnects) on its own thread, reads
    frames on another. ``streams``: the live requests of this front end by engine id."""

    def __init__(self, path: str, secret: str, timeout_s: float = 5.0) -> None:
        self.path = path
        self._secret = secret.encode()
        self._timeout_s = timeout_s  # a scheduler silent this long is lost (its status frames come more often)
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
    def send(self, message: Call) -> None:
        """Send a frame that wants no answer; raises ``EngineStopped`` when the link is down."""
        wire = self._wire
        if wire is None:
            raise EngineStopped(self.reason or "the scheduler link is down")
        try:
            wire.send(encode(message))
        except OSError as exc:  # (a frame may be cut: the link is lost, the reader sees it end)
            wire.close()
            raise EngineStopped(f"the scheduler link is down ({exc})") from None

    def call(self, message: Asking) -> Future[Any]:
        """Send a call (under a call id of its own); its answer (or the engine error it raised) completes the
        returned future."""
        fut: Future[Any] = Future()
        cid = message.cid = next(self._cids)
        with self._lock:
            self._calls[cid] = fut
        try:
            self.send(message)
        except EngineStopped as exc:
            with self._lock:
                self._calls.pop(cid, None)
            fut.set_exception(exc)
        return fut

    async def ask(self, message: Asking) -> Any:
        return await asyncio.wrap_future(self.call(message))

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
            wire.sock.settimeout(self._timeout_s)  # (a stopped scheduler: lost, its requests failed, 503s)
            self._wire = wire
            self.connected.set()
            log.info("connected to the scheduler (unix:%s)", self.path)
            why = "the scheduler closed the link"
            try:
                while True:
                    self._on_frame(decode_news(wire.recv()))
            except TimeoutError:
                why = f"the scheduler sent nothing for {self._timeout_s:g} s (CDB_LINK_TIMEOUT_S)"
            except (OSError, LinkError, EOFError) as exc:
                why = f"the scheduler link was lost ({exc})"
            finally:
                self._wire = None
                self.connected.clear()
                wire.close()
                self._lost(why)

    def _on_frame(self, msg: News) -> None:
        if isinstance(msg, Events):
            self._on_events(msg)
        elif isinstance(msg, Reply):
            with self._lock:
                fut = self._calls.pop(msg.cid, None)
            if fut is None:
                return
            if msg.error is None:
                fut.set_result(msg.value)
            else:
                fut.set_exception(msg.error.exception())
        else:
            self.reason, self.stats = msg.reason, msg.stats

    def _on_events(self, msg: Events) -> None:
        """Each event to its stream, with its text made here (``TextOutput``: the stop-string rule)."""
        streams = self.streams
        for token in msg.tokens:
            key = token.request_id
            stream = streams.get(key)
            if stream is None or stream.text is None:
                continue  # its consumer left and aborted it
            out = stream.text
            if (text := out.token_text(token.token_id, token.depth)) is not None:
                token.text = text  # (a decoded event: this front end's own)
                stream.sink(token)
                if out.stopped:
                    with contextlib.suppress(EngineStopped):  # (a link that is down has ended it already)
                        self.send(Abort(0, key, FinishReason.STOP))
        for finish in msg.finishes:
            key = finish.request_id
            stream = streams.pop(key, None)
            if stream is not None and stream.text is not None:
                stream.sink(stream.text.finish(finish))

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
        caller: str = "",
        streaming: bool = False,
    ) -> RequestStream:
        if not request_id:
            raise InvalidRequest("request_id", "a front end submits requests under their ids")
        text = await self._prep.output_async(params)  # (a resumed stream's: primed off the loop; before the check)
        link = self.link
        if request_id in link.streams:
            raise InvalidRequest("request_id", f"{request_id!r} is already used by a live request")
        stream = RequestStream(lambda: self._abort_own(request_id), observer, text)
        stream.request_id = request_id
        link.streams[request_id] = stream  # before the submit: events may come with the ack
        span = getattr(observer, "span", None)
        traceparent = span.traceparent if span is not None and span.recording else ""
        try:
            await link.ask(Submit(0, request_id, list(prompt_ids), params, traceparent, caller, streaming))
        except BaseException:
            if link.streams.get(request_id) is stream:
                del link.streams[request_id]
            raise
        return stream

    def _abort_own(self, request_id: str) -> None:
        with contextlib.suppress(EngineStopped):  # the link is down: the scheduler has aborted it already
            self.link.send(Abort(0, request_id))

    async def abort(self, request_id: str) -> bool:
        """End a request: one of this front end's at once (True); another's by asking the scheduler."""
        if self.link.streams.get(request_id) is not None:
            self._abort_own(request_id)
            return True
        found: bool = await self.link.ask(Abort(0, request_id))
        return found


class MetricsRelay:
    """The request metrics of a front end (the ``observe_*`` calls ``ObservedRequest`` makes), sent to the
    scheduler's registry in one frame every ``_FLUSH_S``, the per-token ones as two lists (applied there with one
    update per histogram bucket hit); ``exposition`` is the scheduler's."""

    def __init__(self, link: LinkClient) -> None:
        self.link = link
        self._calls: list[tuple[str, list[Any]]] = []
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
                self._calls.append((name, list(args)))

        return record

    async def exposition(self, accept: str | None) -> tuple[bytes, str]:
        body, content_type = await self.link.ask(AskExposition(0, accept))
        return body, content_type

    def flush(self) -> None:
        with self._lock:
            buf, self._calls = self._calls, []
            itls, self._itls = self._itls, []
            depths, self._depths = self._depths, []
        if itls:
            buf.append(("observe_itls", [itls]))
        if depths:
            buf.append(("observe_token_depths", [depths]))
        if buf:
            with contextlib.suppress(EngineStopped):  # the scheduler is gone, and its registry with it
                self.link.send(Observe(buf))

    def _run(self) -> None:
        while not self._stop.wait(_FLUSH_S):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self.flush()
