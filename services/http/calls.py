"""One choice of an HTTP response, admitted at the front door with its metrics and trace.

The door's registry is what makes the drain cover HTTP requests too: a drain waits for them like for gRPC streams,
and at its deadline aborts them (``FrontDoor.cut``), which ends a streamed response with an error event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cdb_engine.limits import INT32_MAX
from services import telemetry
from services.api.door import FrontDoor, Prepare, Ticket
from services.api.errors import Unauthenticated, status_for
from services.api.security import ANONYMOUS_SCOPE
from services.http.responses import Render
from services.telemetry.request_observer import ObservedRequest


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice of a response, one engine request: how it is shaped (``render``, whose ``index`` it is), built
    (``prepare``), and how the engine's field names of its errors read in this API (``fields``); ``prompt``: a
    completion's prompt as sent (what ``echo`` gives back when it is text)."""

    render: Render
    prepare: Prepare
    fields: Mapping[str, str]
    prompt: str | list[int] | None = None

    @property
    def request_id(self) -> str:
        """The engine's id of the choice's request: the response's id, with ``-INDEX`` after the first choice."""
        index = self.render.index
        return self.render.id if index == 0 else f"{self.render.id}-{index}"


async def open_call(
    door: FrontDoor,
    request_id: str,
    prepare: Prepare,
    *,
    operation: str,
    max_tokens: int,
    headers: Iterable[tuple[str, str]],
    caller: str,
    streaming: bool,
) -> Ticket:
    """Admit one choice's request at the door (``prepare``: prompt and params, run on a worker thread) as a request
    of ``caller`` (its share scope; ``streaming``: an SSE response), with its metrics and trace; every refusal
    raises (and is counted) before anything is streamed."""
    span = telemetry.start_request_span(
        model=door.prep.config.model,
        max_tokens=max(-INT32_MAX, min(max_tokens, INT32_MAX)),  # as requested, within a span attribute's range
        metadata=headers,
        request_id=request_id,
        operation=operation,
    )
    observer = ObservedRequest(
        door.metrics,
        door.traces,
        span,
        status_name=lambda e: status_for(e)[0].name,
        deadline_passed=lambda: False,
        cut=lambda: door.cut,
        request_id=request_id,
        caller=lambda: _caller(door, headers),
    )
    return await door.admit(prepare, request_id, observer, caller=caller, streaming=streaming)


def _caller(door: FrontDoor, headers: Iterable[tuple[str, str]]) -> str:
    """The caller's scope, for the request log line (the request was authorised already)."""
    try:
        return door.auth.scope_of(headers)
    except Unauthenticated:  # a key this port's app accepts that the gRPC port's does not: no scope of its own
        return ANONYMOUS_SCOPE
