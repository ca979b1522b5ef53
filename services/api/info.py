"""The ``Info`` reply of a scheduler process: its engine's model, limits and counters, the deployment and its
configuration. A front-end process asks the scheduler's over the link."""

from __future__ import annotations

from cdb_api.v1 import generation_pb2 as pb
from cdb_engine.engine import Engine
from services.api import messages
from services.api.door import FrontDoor
from services.settings import Resolved, served_names
from services.version import server_version


class EngineInfo:
    """Builds the ``Info`` reply of ``engine`` served through ``door``."""

    def __init__(self, engine: Engine, door: FrontDoor) -> None:
        self.engine = engine
        self.door = door
        self.deployment = "microservices" if door.factory is not None else "in_process"
        self.resolved = Resolved(door.settings, engine.config)  # the configuration Info shows

    def reply(self) -> pb.InfoResponse:
        door, settings = self.door, self.door.settings
        executor = door.factory.executor if door.factory is not None else None
        limit = settings.max_concurrent_rpcs
        reply = messages.info_to_pb(self.engine, self.deployment, limit, door.verdict(), executor)
        reply.version = server_version()
        reply.served_model_names.extend(served_names(settings.served_model_name) or [self.engine.config.model])
        reply.config_json, reply.config_digest = self.resolved.shown(), self.resolved.digest()
        if executor is not None:
            reply.stage_config_digests.update(executor.stage_config_digests())
        return reply

    async def __call__(self) -> pb.InfoResponse:
        return self.reply()
