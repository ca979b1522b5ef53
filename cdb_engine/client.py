"""``EngineClient``: what the public front door needs of an engine, wherever the engine runs.

Two implementations: ``InProcessClient`` (the engine in this process) and the remote client of a front-end process
(``services.frontlink.client.RemoteClient``: the engine in the scheduler process, over the front-end link). Both
prepare requests with the same ``RequestPreparer`` and hand events out through the same ``RequestStream``, whose
text the same ``TextOutput`` (a detokenizer with the stop-string rule) makes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cdb_engine.config import RequestParams
from cdb_engine.engine import Engine
from cdb_engine.events import EngineStats, RequestObserver
from cdb_engine.prepare import RequestPreparer
from cdb_engine.stream import RequestStream


class EngineClient(Protocol):
    """An engine as the front door uses it. Called on the door's event loop."""

    @property
    def prep(self) -> RequestPreparer:
        """Validation, tokenization and output text for the engine's model (no engine needed)."""
        ...

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
        """Submit validated ids under ``request_id`` and return the request's stream once the engine has taken it;
        raises ``Overloaded``, ``EngineStopped`` or ``InvalidRequest`` (a duplicate id) before anything streams.
        ``caller``, ``streaming``: the share the request holds of its caller, for an engine that counts the shares
        of several front doors (a remote one: the scheduler's ``CallerShares``; it may raise ``CallerLimit``)."""
        ...

    async def abort(self, request_id: str) -> bool:
        """End a live request (its stream ends with ``FinishReason.CANCELLED``); False if no request has that id."""
        ...

    def stats(self) -> EngineStats:
        """The engine's counters (a remote engine's: as of its last status report)."""
        ...

    def health(self) -> str | None:
        """Why the engine cannot take requests now (None: it can). Cheap: no I/O."""
        ...


class InProcessClient:
    """``EngineClient`` over a started ``Engine`` in this process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._prep = engine.prep

    @property
    def prep(self) -> RequestPreparer:
        return self._prep

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
        # (the door of this process holds the shares: ``caller`` is counted there)
        output = await self._prep.output_async(params)  # (a resumed stream's: primed off the loop)
        return self.engine.open_stream(prompt_ids, params, request_id, observer=observer, output=output)

    async def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def health(self) -> str | None:
        st = self.engine.stats()
        return None if st.healthy else st.error or "engine stopped"
