"""What the sync and asyncio clients share: their address, channel, stubs and each call's defaults.

Clients depend on ``grpc`` and the generated ``cdb_api`` stubs only (no torch, no engine), so they install
anywhere. Errors are ``grpc.RpcError`` with the server's status code (INVALID_ARGUMENT names the field,
UNAUTHENTICATED a missing or wrong API key)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from cdb_api.v1 import generation_pb2_grpc
from clients.balancing import LbPolicy, RetryPolicy
from clients.channel import DEFAULT_RETRY, ChannelOptions, TlsOptions, address_text, api_key_metadata, open_channel

Metadata = Sequence[tuple[str, str]]


class ClientBase:
    """What ``Client`` and ``AsyncClient`` share: the address, each call's default deadline and metadata, the API
    key, the channel (``grpc.aio`` when the class sets ``_AIO``) and its stubs."""

    _AIO: ClassVar[bool] = False
    channel: grpc.Channel | grpc.aio.Channel

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        tls: TlsOptions | None = None,
        api_key: str | None = None,
        lb_policy: LbPolicy | str = LbPolicy.ROUND_ROBIN,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        options: ChannelOptions = (),
    ) -> None:
        self.address = address_text(address)
        self.timeout = timeout
        self.metadata = tuple(metadata)  # e.g. W3C ``traceparent``, sent with every call
        self._auth = api_key_metadata(api_key)
        self.channel = open_channel(address, tls=tls, aio=self._AIO, lb_policy=lb_policy, retry=retry, options=options)
        self._stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _kw(self, timeout: float | None, metadata: Metadata) -> dict[str, object]:
        return {
            "timeout": self.timeout if timeout is None else timeout,
            "metadata": self.metadata + self._auth + tuple(metadata),
        }
