"""gRPC health probe: ``python -m services.healthcheck ADDR [SERVICE] [--timeout S] [--wait S]``.

Asks ``grpc.health.v1.Health/Check`` at ``ADDR`` (``host:port`` or ``unix:/path``) about ``SERVICE`` (default
"": the whole server). Exit status: 0 when SERVING, 1 otherwise (not serving, unknown service, unreachable,
timed out), 2 on bad usage. Used by docker-compose healthchecks, the launcher and the deployment tests; with
``--wait`` it polls until SERVING or the wait runs out.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 2.0) -> str:
    """One probe. Returns the status name (``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN``, ``UNKNOWN``) or
    the gRPC error code name (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``NOT_FOUND``, ...)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            return code.name if code is not None else "UNAVAILABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def wait_serving(address: str, service: str = "", wait: float = 30.0, interval: float = 0.2) -> str:
    """Probe until SERVING or ``wait`` seconds passed; returns the last status."""
    deadline = time.monotonic() + wait
    while True:
        status = check(address, service, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
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
    args = parser.parse_args(argv)
    if args.wait > 0:
        status = wait_serving(args.address, args.service, args.wait)
    else:
        status = check(args.address, args.service, args.timeout)
    if not args.quiet:
        print(f"{args.address} {args.service or '<server>'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
