"""Who may call the public port, and who the caller is: TLS credentials, API keys, caller scopes.

- ``PortSecurity.from_settings(settings)``: the port's TLS credentials (``CDB_TLS_CERT`` / ``CDB_TLS_KEY``; with
  ``CDB_TLS_CLIENT_CA`` client certificates are required) and its ``CallerAuth``; files are read and checked once,
  at start, and a problem is a ``SecurityConfigError`` naming the variable.
- ``CallerAuth``: the API keys (``CDB_API_KEYS``, comma-separated, and ``CDB_API_KEYS_FILE``, one per line, ``#``
  comments). A caller sends ``authorization: Bearer KEY``; keys are compared in constant time against SHA-256
  digests (the keys themselves are not kept).
- ``ApiKeyInterceptor``: refuses a call without a valid key with UNAUTHENTICATED before any handler runs;
  ``grpc.health.v1`` stays open (load balancer and Kubernetes probes send no metadata), reflection does not.
- ``CallerAuth.scope(context)``: the caller's scope, which request ids and Abort live in: ``key-<digest>`` (12 hex
  digits of a digest of its API key; never the key) when keys are on, else ``cert-<digest>`` of the verified
  client certificate's subject (mTLS), else ``anon``: without keys or client certificates all callers share one
  scope. ``CallerAuth.share_scope(context)``: the scope its limits count in (``shares``): the same, but its host's
  instead of ``anon``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.api.errors import Unauthenticated, status_for
from services.api.shares import ANONYMOUS_SCOPE, grpc_peer_host, share_scope
from services.settings import Settings

log = logging.getLogger("cdb.scheduler")

OPEN_SERVICES = ("grpc.health.v1.Health",)  # callable without a key
_BEARER = "bearer "


class SecurityConfigError(ValueError):
    """A TLS file or an API key source is unusable; the message names the setting."""


def _digest(label: bytes, value: bytes) -> bytes:
    return hashlib.sha256(label + value).digest()


def _key_digest(key: str) -> bytes:
    return _digest(b"cdb-api-key\0", key.encode())


def _short_id(label: bytes, value: bytes) -> str:
    return _digest(label, value).hex()[:12]


def _bearer(metadata: Iterable[Any] | None) -> str | None:
    """The ``authorization`` metadata value (the first one), or None."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class CallerAuth:
    """The accepted API keys (none: every caller is accepted) and the caller-scope rule."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = tuple(sorted({_key_digest(k) for k in keys}))

    @property
    def keys_on(self) -> bool:
        return bool(self._digests)

    @property
    def num_keys(self) -> int:
        return len(self._digests)

    def refusal(self, metadata: Iterable[Any] | None) -> str | None:
        """Why a call with this invocation metadata is refused (None: accepted)."""
        if not self._digests:
            return None
        header = _bearer(metadata)
        if header is None:
            return "missing API key: send metadata 'authorization: Bearer KEY'"
        if not header.lower().startswith(_BEARER) or not header[len(_BEARER) :].strip():
            return "malformed authorization metadata: expected 'Bearer KEY'"
        presented = _key_digest(header[len(_BEARER) :].strip())
        accepted = False
        for digest in self._digests:  # every key compared, in constant time: no early exit
            accepted |= hmac.compare_digest(presented, digest)
        return None if accepted else "invalid API key"

    def scope(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's scope (see the module docstring); raises ``Unauthenticated`` for a refused key."""
        subjects = context.auth_context().get("x509_subject")
        return self.scope_of(context.invocation_metadata(), subjects[0] if subjects else None)

    def share_scope(self, context: grpc.aio.ServicerContext) -> str:
        """The scope the caller's limits count in (``shares.share_scope``): ``scope``, but its host's instead of
        the one anonymous scope."""
        return share_scope(self.scope(context), grpc_peer_host(context.peer()))

    def scope_of(self, metadata: Iterable[Any] | None, cert_subject: bytes | None = None) -> str:
        """The scope of a caller with this metadata (``(name, value)`` pairs, lower-case names: gRPC metadata or
        HTTP headers) and verified client-certificate subject; raises ``Unauthenticated`` for a refused key."""
        metadata = tuple(metadata or ())
        if self._digests:
            why = self.refusal(metadata)
            if why is not None:
                raise Unauthenticated(why)
            key = (_bearer(metadata) or "")[len(_BEARER) :].strip()
            return "key-" + _short_id(b"cdb-caller\0", key.encode())
        if cert_subject:
            return "cert-" + _short_id(b"cdb-cert-subject\0", cert_subject)
        return ANONYMOUS_SCOPE


def _refusing_handler(handler: grpc.RpcMethodHandler | None, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts UNAUTHENTICATED without reading the request."""

    code, message = status_for(Unauthenticated(why))

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    def ignore(_: bytes) -> None:
        return None

    if handler is not None and handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse, request_deserializer=ignore)
    if handler is not None and handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=ignore)
    if handler is not None and handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, request_deserializer=ignore)
    return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=ignore)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call without a valid API key, except to ``OPEN_SERVICES``; no handler runs."""

    def __init__(self, auth: CallerAuth) -> None:
        self.auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        if method.lstrip("/").partition("/")[0] in OPEN_SERVICES:
            return await continuation(handler_call_details)
        why = self.auth.refusal(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if why is None:
            return handler
        log.debug("refused %s: %s", method, why)
        return _refusing_handler(handler, why)


def _read(variable: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{variable}: cannot read {path}: {exc.strerror or exc}") from None


def read_api_keys(settings: Settings) -> list[str]:
    """The keys of ``CDB_API_KEYS`` and ``CDB_API_KEYS_FILE``; raises ``SecurityConfigError``."""
    sources = [("CDB_API_KEYS", i + 1, k.strip()) for i, k in enumerate(settings.api_keys.split(","))]
    sources = [s for s in sources if s[2]]
    if settings.api_keys_file:
        text = _read("CDB_API_KEYS_FILE", settings.api_keys_file).decode("utf-8", errors="replace")
        lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
        found = [("CDB_API_KEYS_FILE", n, line) for n, line in lines if line and not line.startswith("#")]
        if not found:
            raise SecurityConfigError(f"CDB_API_KEYS_FILE: {settings.api_keys_file} holds no key")
        sources += found
        mode = Path(settings.api_keys_file).stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("CDB_API_KEYS_FILE %s is readable by other users (mode %o)", settings.api_keys_file, mode)
    for variable, where, key in sources:
        if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
            place = f"line {where}" if variable.endswith("FILE") else f"key {where}"
            raise SecurityConfigError(f"{variable}: {place} is not a printable ASCII key without spaces")
    return [key for _, _, key in sources]


def _check_tls(settings: Settings, client_ca: bytes | None) -> None:
    """Load the PEM files into an ``ssl`` context: a bad file fails at start, naming the variable."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
    except ssl.SSLError as exc:
        raise SecurityConfigError(
            f"CDB_TLS_CERT / CDB_TLS_KEY: {settings.tls_cert} and {settings.tls_key} are not a matching PEM "
            f"certificate chain and private key ({exc.reason or exc})"
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii", errors="replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise SecurityConfigError(
                f"CDB_TLS_CLIENT_CA: {settings.tls_client_ca} is not a PEM CA bundle ({exc})"
            ) from None


@dataclass(frozen=True)
class PortSecurity:
    """The public port's TLS credentials (None: plaintext) and its callers' authentication."""

    credentials: grpc.ServerCredentials | None
    auth: CallerAuth
    client_certificates: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> PortSecurity:
        """Read and check the TLS files and API keys of ``settings``; raises ``SecurityConfigError``."""
        auth = CallerAuth(read_api_keys(settings))
        if not settings.tls_cert:
            return cls(None, auth)
        cert = _read("CDB_TLS_CERT", settings.tls_cert)
        key = _read("CDB_TLS_KEY", settings.tls_key)
        client_ca = _read("CDB_TLS_CLIENT_CA", settings.tls_client_ca) if settings.tls_client_ca else None
        _check_tls(settings, client_ca)
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
        return cls(credentials, auth, client_ca is not None)

    def describe(self) -> str:
        """E.g. ``TLS, client certificates required, 2 API keys`` or ``plaintext, no API keys``."""
        transport = "plaintext" if self.credentials is None else "TLS"
        if self.client_certificates:
            transport += ", client certificates required"
        n = self.auth.num_keys
        keys = f"{n} API key{'s' if n != 1 else ''}" if n else "no API keys"
        return f"{transport}, {keys}"

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [ApiKeyInterceptor(self.auth)] if self.auth.keys_on else []
