"""How a client reaches a server: ``open_channel``, the one place a channel is made (one address or several
replicas, the load-balancing and retry policies of ``clients.balancing``), TLS (``TlsOptions``: the CA that signed
the server's certificate; a client certificate and key for mTLS) and the API key, sent as ``authorization: Bearer
KEY`` on every call (``api_key_metadata``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, overload

import grpc

from clients.balancing import LbPolicy, RetryPolicy, channel_options, channel_target

ChannelOptions = Sequence[tuple[str, str | int]]
DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """TLS of a client channel, PEM bytes. ``root_certificates`` None: the system's trusted roots."""

    root_certificates: bytes | None = None  # the CA bundle that signed the server's certificate
    certificate_chain: bytes | None = None  # mTLS: this client's certificate ...
    private_key: bytes | None = field(default=None, repr=False)  # ... and its key
    server_name: str | None = None  # the name to check in the server's certificate, if not the address's host

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate and its private key go together: give both or neither")

    @classmethod
    def from_files(
        cls,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        server_name: str | None = None,
    ) -> TlsOptions:
        """Read PEM files (any may be None); raises ValueError naming an unreadable file."""
        return cls(_read_file(ca, "CA"), _read_file(cert, "client certificate"), _read_file(key, "key"), server_name)


def _read_file(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None


def read_api_key_file(path: str) -> str:
    """The API key in ``path``: its first line that is neither empty nor a ``#`` comment."""
    data = _read_file(path, "API key")
    assert data is not None
    for line in data.decode("utf-8", errors="replace").splitlines():
        if (key := line.strip()) and not key.startswith("#"):
            return key
    raise ValueError(f"the API key file {path} holds no key")


def api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries ``api_key`` (none for None or an empty key)."""
    if not api_key:
        return ()
    if any(c.isspace() for c in api_key) or not api_key.isascii() or not api_key.isprintable():
        raise ValueError("an API key is printable ASCII without spaces")
    return (("authorization", f"Bearer {api_key}"),)


@overload
def open_channel(
    address: str | Sequence[str],
    *,
    tls: TlsOptions | None = ...,
    aio: Literal[False] = ...,
    options: ChannelOptions = ...,
    lb_policy: LbPolicy | str = ...,
    retry: RetryPolicy | None = ...,
) -> grpc.Channel: ...


@overload
def open_channel(
    address: str | Sequence[str],
    *,
    tls: TlsOptions | None = ...,
    aio: Literal[True],
    options: ChannelOptions = ...,
    lb_policy: LbPolicy | str = ...,
    retry: RetryPolicy | None = ...,
) -> grpc.aio.Channel: ...


@overload
def open_channel(
    address: str | Sequence[str],
    *,
    tls: TlsOptions | None = ...,
    aio: bool,
    options: ChannelOptions = ...,
    lb_policy: LbPolicy | str = ...,
    retry: RetryPolicy | None = ...,
) -> grpc.Channel | grpc.aio.Channel: ...


def open_channel(
    address: str | Sequence[str],
    *,
    tls: TlsOptions | None = None,
    aio: bool = False,
    options: ChannelOptions = (),
    lb_policy: LbPolicy | str = LbPolicy.ROUND_ROBIN,
    retry: RetryPolicy | None = DEFAULT_RETRY,
) -> grpc.Channel | grpc.aio.Channel:
    """A channel to ``address``: ``HOST:PORT``, ``unix:PATH``, a gRPC target (``dns:///NAME:PORT``), or several
    IP:PORT addresses (a sequence or comma-separated) to balance over (``clients.balancing``). ``lb_policy``:
    ``round_robin`` or ``pick_first``; ``retry``: the retry policy of ``cdb.v1.Generation`` calls (None: no
    retries); ``options``: more channel arguments, which win over the defaults. TLS with ``tls``, else plaintext;
    ``aio``: a ``grpc.aio`` channel (create it inside a running event loop). Raises ValueError naming a bad
    address or policy."""
    target = channel_target(address)
    opts = channel_options(options, lb_policy, retry)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=opts) if aio else grpc.insecure_channel(target, options=opts)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
    if aio:
        return grpc.aio.secure_channel(target, credentials, options=opts)
    return grpc.secure_channel(target, credentials, options=opts)


def address_text(address: str | Sequence[str]) -> str:
    """``address`` as one string, for messages."""
    return address if isinstance(address, str) else ",".join(address)
