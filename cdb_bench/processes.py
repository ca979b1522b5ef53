"""Processes the benchmarks start: free loopback ports, ``cdb serve`` trees started and stopped side by side, a
Python child that says when it is ready, and the CPU a process has used."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from cdb_engine.config import EngineConfig
from services.launcher import ServeHandle, serve_all

LOOPBACK = "127.0.0.1"


_FIRST_PORT = 10_000  # free ports are drawn from here up to the kernel's ephemeral range
_handed: set[int] = set()  # the ports this process handed out (never twice)


def _ephemeral_start() -> int:
    """Where the kernel's ephemeral ports start (what it gives a bind to port 0), or 0 where it does not say."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host: str = LOOPBACK) -> int:
    """A port free on ``host`` now, that its user binds a moment later. It is drawn below the kernel's ephemeral
    range: the servers of a tree bind port 0 for their own listeners, and a port the kernel hands out that way
    could be this one, taken in that moment (a health check then reads a gRPC server's HTTP/2 frames). Where the
    range is not known, one the kernel picks."""
    start = _ephemeral_start()
    draw = random.SystemRandom()
    for _ in range(64 if start > _FIRST_PORT + 1024 else 0):
        port = draw.randrange(_FIRST_PORT, start)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_address(host: str = LOOPBACK) -> str:
    """``HOST:PORT`` on a port free now (``free_port``)."""
    return f"{host}:{free_port(host)}"


def with_public_caps(env: Mapping[str, str], max_live: int) -> dict[str, str]:
    """``env`` with the public server's RPC cap (``CDB_MAX_CONCURRENT_RPCS``) and the caller's share
    (``CDB_MAX_REQUESTS_PER_CALLER``: a benchmark client is one caller) raised to hold ``max_live`` requests and a
    margin: an overloaded tree shows latency, not refusals."""
    cap = max(int(env.get("CDB_MAX_CONCURRENT_RPCS", "1024")), max_live + 64)
    share = env.get("CDB_MAX_REQUESTS_PER_CALLER") or str(max_live + 64)
    return {**env, "CDB_MAX_CONCURRENT_RPCS": str(cap), "CDB_MAX_REQUESTS_PER_CALLER": share}


def _each_at_once(fn: Callable[[int], None], n: int, name: str) -> None:
    threads = [threading.Thread(target=fn, args=(i,), name=f"{name}-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def start_trees(
    config: EngineConfig, addresses: Sequence[str], env: Mapping[str, str]
) -> tuple[list[ServeHandle], list[BaseException]]:
    """A tree of ``config`` listening on each address, all started at once (a start is mostly interpreter and
    torch start-up); the trees that started, in order, and the errors of those that did not."""
    trees: list[ServeHandle | None] = [None] * len(addresses)
    errors: list[BaseException] = []

    def start(i: int) -> None:
        try:
            trees[i] = serve_all(config, addresses[i], env=env)
        except BaseException as exc:  # reported by the caller once every start has ended
            errors.append(exc)

    _each_at_once(start, len(addresses), "tree-start")
    return [t for t in trees if t is not None], errors


def stop_trees(trees: Sequence[ServeHandle], drain_timeout: float) -> None:
    """Stop every tree at once, each draining for at most ``drain_timeout`` seconds."""
    _each_at_once(lambda i: trees[i].stop(drain_timeout=drain_timeout), len(trees), "tree-stop")


@contextmanager
def trees(
    config: EngineConfig, addresses: Sequence[str], env: Mapping[str, str], drain_timeout: float
) -> Iterator[list[ServeHandle]]:
    """``start_trees``, raising the first error (once the others are stopped); stops them all on leaving."""
    started, errors = start_trees(config, addresses, env)
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        stop_trees(started, drain_timeout)


def start_python(args: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """``python ARGS`` (this interpreter) with its stdout piped as text; the process and the first line it printed,
    which such a child prints once it is ready (empty if it exited first)."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    return proc, proc.stdout.readline()


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``; OSError if it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15 of proc(5)
