"""gRPC health probe: ``python -m services.healthcheck ADDR [SERVICE] [--timeout S] [--wait S]``.

Asks ``grpc.health.v1.Health/Check`` at ``ADDR`` (``host:port`` or ``unix:/path``) about ``SERVICE`` (default
"": the whole server). Exit status: 0 when SERVING, 1 otherwise (not serving, unknown service, unreachable,
timed out), 2 on bad usage. Used by docker-compose healthchecks, Kubernetes exec probes and the deployment tests;
with ``--wait`` it polls until SERVING or the wait runs out. A public port with TLS: ``--tls-ca PEM`` (and
``--tls-cert/--tls-key`` under mTLS; ``--tls-server-name`` when the address is not in the certificate). Health
needs no API key.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(frozen=True, slots=True)
class ProbeTls:
    """TLS for a probe of a public port: the CA bundle, and the client certificate under mTLS."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str = ""

    @classmethod
    def from_files(cls, ca: str | None, cert: str | None, key: str | None, server_name: str = "") -> ProbeTls:
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        return cls(read(ca), read(cert), read(key), server_name)


def _channel(address: str, tls: ProbeTls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(address: str, service: str = "", timeout: float = 2.0, tls: ProbeTls | None = None) -> str:
    """One probe. Returns the status name (``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN``, ``UNKNOWN``) or
    the gRPC error code name (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``NOT_FOUND``, ...)."""
    with _channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            return code.name if code is not None else "UNAVAILABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def wait_serving(
    address: str, service: str = "", wait: float = 30.0, interval: float = 0.2, tls: ProbeTls | None = None
) -> str:
    """Probe until SERVING or ``wait`` seconds passed; returns the last status."""
    deadline = time.monotonic() + wait
    while True:
        status = check(address, service, timeout=max(0.1, min(2.0, deadline - time.monotonic())), tls=tls)
        if status == "SERVING" or time.monotonic() >= deadline:
            return status
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port or unix:/path of the gRPC server")
    parser.add_argument("service", nargs="?", default="", help='service name to ask about (default "": server)')
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per probe (default 2)")
    parser.add_argument("--wait", type=float, default=0.0, help="poll up to this many seconds for SERVING")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    parser.add_argument("--tls", action="store_true", help="TLS with the system's CA roots")
    parser.add_argument("--tls-ca", metavar="PEM", help="TLS, trusting this CA bundle")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", metavar="PEM", help="client key (mTLS)")
    parser.add_argument("--tls-server-name", default="", help="the name to expect in the server's certificate")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    try:
        use_tls = args.tls or args.tls_ca or args.tls_cert
        tls = ProbeTls.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name) if use_tls else None
    except OSError as exc:
        parser.error(f"cannot read a TLS file: {exc}")
    if args.wait > 0:
        status = wait_serving(args.address, args.service, args.wait, tls=tls)
    else:
        status = check(args.address, args.service, args.timeout, tls=tls)
    if not args.quiet:
        print(f"{args.address} {args.service or '<server>'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
