"""Spreading one client's calls over several replicas with what gRPC has: a target it resolves to many addresses,
and a service config (the load-balancing policy and a retry policy) carried by every channel.

Targets (``channel_target``):

- one address, passed through: ``HOST:PORT`` (a host name is resolved by gRPC's DNS resolver and *every* address
  it returns is a backend), ``unix:PATH``, or any gRPC target URI, e.g. ``dns:///cdb-headless.cdb.svc.cluster.
  local:50051`` (a Kubernetes headless Service resolves to one address per ready Pod; gRPC re-resolves when a
  connection drops, so replicas that come and go are followed);
- several addresses, a sequence or one comma-separated string: **IP literals** only, all of one family:
  ``127.0.0.1:5001,127.0.0.1:5002`` becomes ``ipv4:127.0.0.1:5001,127.0.0.1:5002``, ``[::1]:5001,[::1]:5002``
  becomes ``ipv6:[::1]:5001,[::1]:5002``. A list of host names is refused: gRPC Python cannot register a resolver
  of its own, and resolving names once here would freeze them. Give one DNS name that resolves to all replicas.

The service config (``service_config``): ``loadBalancingConfig`` is ``round_robin`` (each call goes to the next
READY backend; a backend whose connection fails leaves the rotation until it reconnects) or ``pick_first`` (all
calls to the first backend that connects, the next one only when it fails). The retry policy covers every method
of ``cdb.v1.Generation`` but ``GenerateStream`` (not ``grpc.health.v1``: a health check asks one replica): a call
that ends with ``UNAVAILABLE`` or ``RESOURCE_EXHAUSTED`` is sent again, on the backend the policy picks next, at
most ``max_attempts`` times in all, after randomized exponential backoff (attempt n waits a uniform random time in
[0, min(initial · multiplier^(n-1), max)]). A unary ``Generate`` is retried as a whole (nothing was delivered).
The call's deadline covers every attempt.

Streams are the clients' own business (``Client.stream``): a stream that breaks because its server died or drained
(``UNAVAILABLE``), before or after its first token, or that is refused for load (``RESOURCE_EXHAUSTED``) before it,
is sent again on the backend the policy picks next, carrying the tokens it had delivered
(``GenerateRequest.resume``): it continues exactly where it stopped and delivers nothing twice. gRPC's transparent
retries cannot do that (a stream that delivered a token is committed), and they left uncommitted streams of a
killed server waiting past their deadline, so ``GenerateStream`` has no retry policy.
"""

from __future__ import annotations

import enum
import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

GENERATION_SERVICE = "cdb.v1.Generation"
RETRIED_METHODS = ("Generate", "Abort", "Info")  # not GenerateStream: the clients resume streams themselves


class LbPolicy(enum.StrEnum):
    """gRPC's built-in load-balancing policies a client may choose."""

    ROUND_ROBIN = "round_robin"
    PICK_FIRST = "pick_first"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """gRPC's retry policy for ``cdb.v1.Generation`` calls (``retryPolicy`` of the service config)."""

    max_attempts: int = 3  # the first call included; gRPC caps it at 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 1.0
    backoff_multiplier: float = 2.0
    codes: tuple[str, ...] = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts: 2 to 5 (gRPC's cap), got {self.max_attempts}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"initial_backoff_s and max_backoff_s: 0 < initial <= max, got {self.initial_backoff_s} and "
                f"{self.max_backoff_s}"
            )
        if not self.backoff_multiplier > 0:
            raise ValueError(f"backoff_multiplier: > 0, got {self.backoff_multiplier}")
        names = {c.name for c in grpc.StatusCode} - {"OK"}
        if not self.codes or any(c not in names for c in self.codes):
            raise ValueError(f"codes: gRPC status code names other than OK, got {list(self.codes)}")

    def to_json(self) -> dict[str, Any]:
        return {
            "maxAttempts": self.max_attempts,
            "initialBackoff": f"{self.initial_backoff_s:g}s",
            "maxBackoff": f"{self.max_backoff_s:g}s",
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": list(self.codes),
        }


def service_config(lb_policy: LbPolicy | str = LbPolicy.ROUND_ROBIN, retry: RetryPolicy | None = None) -> str:
    """The JSON service config of a client channel: ``lb_policy`` and, unless None, ``retry`` for every
    ``cdb.v1.Generation`` method."""
    config: dict[str, Any] = {"loadBalancingConfig": [{_lb_policy(lb_policy).value: {}}]}
    if retry is not None:
        names = [{"service": GENERATION_SERVICE, "method": m} for m in RETRIED_METHODS]
        config["methodConfig"] = [{"name": names, "retryPolicy": retry.to_json()}]
    return json.dumps(config)


def _lb_policy(value: LbPolicy | str) -> LbPolicy:
    try:
        return LbPolicy(value)
    except ValueError:
        raise ValueError(f"lb_policy: one of {', '.join(p.value for p in LbPolicy)}, got {value!r}") from None


# A string that starts with one of these is one gRPC target URI, passed through as it is.
TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")


def split_addresses(address: str | Sequence[str]) -> list[str]:
    """The addresses of ``address``: a sequence, or a string split at commas (blanks stripped); a string that
    starts with a gRPC target scheme (``TARGET_SCHEMES``) is one target."""
    if isinstance(address, str):
        items = [address] if address.strip().startswith(TARGET_SCHEMES) else address.split(",")
    else:
        items = list(address)
    out = [a.strip() if isinstance(a, str) else a for a in items]
    if not out or any(not isinstance(a, str) or not a for a in out):
        raise ValueError(f"address: expected HOST:PORT, several of them, or a gRPC target; got {address!r}")
    return out


def channel_target(address: str | Sequence[str]) -> str:
    """The gRPC target for one address (passed through) or several IP literals (``ipv4:`` / ``ipv6:`` list)."""
    addresses = split_addresses(address)
    if len(addresses) == 1:
        return addresses[0]
    parsed = [_ip_port(a) for a in addresses]
    families = {ip.version for ip, _ in parsed}
    if len(families) > 1:
        raise ValueError(f"address: several addresses must all be IPv4 or all IPv6, got {', '.join(addresses)}")
    if families == {4}:
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in parsed)
    return "ipv6:" + ",".join(f"[{ip}]:{port}" for ip, port in parsed)


def _ip_port(address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, sep, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
        number = int(port)
    except ValueError:
        ip, number = None, 0
    if not sep or ip is None or not 0 < number < 65536 or bracketed != (ip.version == 6):
        raise ValueError(
            f"address: several addresses must be IP:PORT literals (IPv6 as [IP]:PORT), got {address!r}; for host "
            "names give one DNS name that resolves to every replica, e.g. dns:///cdb-headless.cdb.svc.cluster.local"
            ":50051"
        )
    return ip, number


# Keepalive: a connection to a replica whose node died (no FIN, no RST) is found dead within about 40 s, so its
# open streams fail UNAVAILABLE instead of waiting for their deadline; 30 s respects the server's minimum ping
# interval (CDB_KEEPALIVE_MIN_TIME_S, 10 s), and pings continue on a stream that receives nothing for a while.
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
)


def channel_options(
    options: Sequence[tuple[str, str | int]],
    lb_policy: LbPolicy | str = LbPolicy.ROUND_ROBIN,
    retry: RetryPolicy | None = None,
) -> list[tuple[str, str | int]]:
    """The channel arguments: the service config of ``lb_policy`` and ``retry`` and the keepalive defaults, then
    ``options``, which win over any of them with the same key (``grpc.service_config`` replaces the whole config;
    ``grpc.lb_policy_name`` selects the policy)."""
    given = dict(options)
    policy = given.get("grpc.lb_policy_name", lb_policy)
    if not isinstance(policy, str):
        raise ValueError(f"grpc.lb_policy_name: a policy name, got {policy!r}")
    defaults: list[tuple[str, str | int]] = [
        ("grpc.service_config", service_config(policy, retry)),
        ("grpc.service_config_disable_resolution", 1),  # ours, not one a DNS TXT record may carry
        ("grpc.enable_retries", 1 if retry is not None else 0),
        *KEEPALIVE_OPTIONS,
    ]
    return [(k, v) for k, v in defaults if k not in given] + [(k, v) for k, v in options if k != "grpc.lb_policy_name"]
