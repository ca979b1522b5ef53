"""``Readiness``: the periodic health check of a serving process, fed into ``grpc.health.v1`` and into the front
door's verdict (``FrontDoor.not_ready``).

SERVING only while the engine client is healthy (a remote engine: the scheduler's own verdict, as its link
reports it), the engine is either idle or making progress, every stage is attached (no outage) and answers its own
health check. When the executor gives up on the stages (down past ``CDB_STAGE_DOWN_LIMIT_S``) ``on_fatal`` runs
once: the server stops and the process exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cdb_api.v1 import generation_pb2 as pb
from cdb_scheduler.plan import Stage
from services.api.door import FrontDoor
from services.settings import Settings

log = logging.getLogger("cdb.scheduler")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Readiness:
    """Periodic readiness check feeding ``grpc.health.v1`` (overall "" and ``cdb.v1.Generation``)."""

    def __init__(self, door: FrontDoor, stage_addrs: Mapping[Stage, str] | None, settings: Settings):
        self.door = door
        self.settings = settings
        self.health = health.aio.HealthServicer()
        self.reason: str | None = "starting"
        self._stage_addrs = dict(stage_addrs or {})
        self._channels: dict[str, grpc.aio.Channel] = {}  # by address: a standby that took over is probed too
        self.on_fatal: Callable[[], None] | None = None  # called once when the stages are given up on
        self.fatal: str | None = None
        self._busy_since: float | None = None
        self.first_ready = asyncio.Event()

    async def check(self) -> str | None:
        """Why the server is not ready, or None."""
        door = self.door
        why = door.client.health()
        if why is not None:
            return why
        if door.broken:
            self._fatal(door.broken)
            return door.broken
        executor = door.factory.executor if door.factory is not None else None
        if executor is not None and executor.outage is not None:
            return f"re-attaching the stages after: {executor.outage}"
        st, now = door.client.stats(), time.monotonic()
        if st.waiting + st.running == 0:
            self._busy_since = None
        else:
            self._busy_since = self._busy_since or now
            since = max(st.last_progress_monotonic, self._busy_since)
            if now - since > self.settings.stall_timeout_s:
                return f"no engine progress for {now - since:.1f}s with {st.waiting + st.running} requests"
        addrs = executor.stage_addrs if executor is not None else self._stage_addrs  # the stages serving now
        probes = [self._probe(stage, self._channel(address)) for stage, address in addrs.items()]
        failures = [why for why in await asyncio.gather(*probes) if why]
        return "; ".join(failures) or None

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=options)
        return channel

    def _fatal(self, why: str) -> None:
        if self.fatal is None:
            self.fatal = why
            log.error("stages given up on: %s; exiting so that an orchestrator restarts the group", why)
            if self.on_fatal is not None:
                self.on_fatal()

    async def _probe(self, stage: Stage, channel: grpc.aio.Channel) -> str | None:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.settings.stage_probe_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"{stage.role} stage does not answer ({exc.code().name})"
        return None if reply.status == _SERVING else f"{stage.role} stage not serving"

    async def run(self) -> None:
        """Re-check every ``health_interval_s`` until cancelled; log transitions."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _NOT_SERVING)
        while True:
            reason = await self.check()
            if reason != self.reason:
                log.info("readiness: %s", "SERVING" if reason is None else f"NOT_SERVING ({reason})")
                for name in ("", SERVICE_NAME):
                    await self.health.set(name, _SERVING if reason is None else _NOT_SERVING)
                self.reason = self.door.not_ready = reason
            if reason is None:
                self.first_ready.set()
            await asyncio.sleep(self.settings.health_interval_s)  # a period, not a synchronisation

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
