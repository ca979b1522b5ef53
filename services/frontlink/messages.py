"""The front-end link's messages: typed structs, one per kind, encoded as MessagePack (msgspec).

A frame decodes only into the messages its direction carries (``decode_call`` on the scheduler's end,
``decode_news`` on a front end's), field by field against these types: a peer can send data and nothing else, and
a frame that is not such a message is a ``LinkError``. A call that wants an answer carries a call id (``cid``; 0:
no answer wanted); the answer is a ``Reply`` with that id.
"""

from __future__ import annotations

from typing import Any

import msgspec

from cdb_engine import errors
from cdb_engine.config import RequestParams
from cdb_engine.events import EngineStats, Event, FinishEvent, TokenEvent
from cdb_scheduler.request import FinishReason


class LinkError(ConnectionError):
    """The link is closed, or its peer failed the handshake or sent a frame it may not."""


# --- front end -> scheduler ---------------------------------------------------------------------------------------
class Submit(msgspec.Struct, tag="submit", array_like=True):
    """Submit a validated request under ``key``; ``traceparent``: its span's, for the stage hops (empty: none);
    ``caller``, ``streaming``: the share it takes of its caller in the scheduler's count (empty: none)."""

    cid: int
    key: str
    ids: list[int]
    params: RequestParams
    traceparent: str = ""
    caller: str = ""
    streaming: bool = False


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """End request ``key`` (a front end that found a stop string ends it with ``FinishReason.STOP``)."""

    cid: int
    key: str
    reason: FinishReason = FinishReason.CANCELLED


class AskInfo(msgspec.Struct, tag="info", array_like=True):
    """The ``Info`` reply (its serialized protobuf)."""

    cid: int


class AskExposition(msgspec.Struct, tag="exposition", array_like=True):
    """The registry's Prometheus exposition for the ``Accept`` header ``accept``: ``[body, content type]``."""

    cid: int
    accept: str | None = None


class Observe(msgspec.Struct, tag="observe", array_like=True):
    """Request metrics a front end recorded: ``(observe_* method, its arguments)``, applied to the registry."""

    calls: list[tuple[str, list[Any]]]


# --- scheduler -> front end ---------------------------------------------------------------------------------------
class Events(msgspec.Struct, tag="events", array_like=True):
    """What one engine hand-over produced for the front end's requests. A request's events keep their order: its
    tokens precede its finish, and every finish comes after every token of the frame."""

    tokens: list[TokenEvent]
    finishes: list[FinishEvent]

    @classmethod
    def of(cls, events: list[Event]) -> Events:
        return cls([e for e in events if isinstance(e, TokenEvent)], [e for e in events if isinstance(e, FinishEvent)])


class Refusal(msgspec.Struct, array_like=True):
    """An engine error (a caller's ``CallerLimit`` too) raised by a call, raised again on the front end
    (``InvalidRequest`` keeps its field)."""

    kind: str
    message: str
    field: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> Refusal:
        if isinstance(exc, errors.InvalidRequest):
            return cls("InvalidRequest", exc.message, exc.field)
        return cls(type(exc).__name__, str(exc))

    def exception(self) -> errors.EngineError:
        if self.kind == "InvalidRequest":
            return errors.InvalidRequest(self.field, self.message)
        cls = getattr(errors, self.kind, None)
        if isinstance(cls, type) and issubclass(cls, errors.EngineError):
            return cls(self.message)
        return errors.EngineStopped(f"{self.kind}: {self.message}")


class Reply(msgspec.Struct, tag="reply", array_like=True):
    """The answer of call ``cid``: ``value``, or the engine error it raised."""

    cid: int
    error: Refusal | None = None
    value: Any = None


class Status(msgspec.Struct, tag="status", array_like=True):
    """The scheduler's readiness verdict (None: ready) and the engine's counters."""

    reason: str | None
    stats: EngineStats


Call = Submit | Abort | AskInfo | AskExposition | Observe
News = Events | Reply | Status

_calls = msgspec.msgpack.Decoder(Call)
_news = msgspec.msgpack.Decoder(News)


def encode(message: Call | News) -> bytes:
    return msgspec.msgpack.encode(message)


def decode_call(data: bytes) -> Call:
    """A frame a front end sent; ``LinkError`` for anything but one of its messages."""
    try:
        return _calls.decode(data)
    except msgspec.DecodeError as exc:
        raise LinkError(f"not a message of the front-end link: {exc}") from None


def decode_news(data: bytes) -> News:
    """A frame the scheduler sent; ``LinkError`` for anything but one of its messages."""
    try:
        return _news.decode(data)
    except msgspec.DecodeError as exc:
        raise LinkError(f"not a message of the front-end link: {exc}") from None
