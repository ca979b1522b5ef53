"""Addresses and readiness files: the network helpers every process of the tree shares.

- ``is_host_port`` / ``require_loopback`` / ``bound_address``: address checks and the address clients use.
- ``parse_stage_addrs``: ``--stage ROLE=ADDRESS`` options into addresses by stage.
- ``write_ready_file`` / ``wait_ready_file``: a child publishes its bound address once it serves (atomic
  rename); the launcher waits for it and fails fast if the child exits first.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cdb_scheduler.plan import Stage


def is_host_port(address: str) -> bool:
    """``HOST:PORT`` or ``:PORT`` with a port in 0..65535 (HOST may be empty: all interfaces)."""
    port = address.rpartition(":")[2]
    return ":" in address and port.isdigit() and int(port) < 65536


def require_loopback(listen: str) -> str:
    """Return ``listen`` if it is a Unix socket or a loopback host:port; raise ValueError otherwise."""
    if listen.startswith("unix:"):
        return listen
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address must be unix:PATH or HOST:PORT, got {listen!r}")
    host = host.strip("[]")
    if host == "localhost":
        return listen
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"stage servers listen on loopback or unix sockets only, refusing {listen!r}")
    return listen


def bound_address(listen: str, port: int) -> str:
    """The address clients use: ``listen`` with a port-0 request replaced by the bound port."""
    if listen.startswith("unix:"):
        return listen
    return f"{listen.rpartition(':')[0]}:{port}"


def parse_stage_addrs(specs: Sequence[str]) -> dict[Stage, str]:
    """``["prelude=ADDR", "loop=ADDR", "head=ADDR"]`` -> addresses by stage; all three required."""
    addrs: dict[Stage, str] = {}
    roles = "|".join(s.role for s in Stage)
    for spec in specs:
        role, sep, address = spec.partition("=")
        if not sep or not address or role not in Stage.roles():
            raise ValueError(f"--stage must be ROLE=ADDRESS with ROLE in {roles}, got {spec!r}")
        addrs[Stage.from_role(role)] = address
    missing = [s.role for s in Stage if s not in addrs]
    if missing:
        raise ValueError(f"missing --stage for {', '.join(missing)} (or use --in-process)")
    return addrs


def write_ready_file(path: str, address: str) -> None:
    """Publish ``address`` atomically (readers never see a partial file)."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(address)
    os.replace(tmp, path)


def wait_ready_file(path: str, proc: subprocess.Popen[Any], timeout: float, what: str) -> str:
    """The address ``proc`` publishes in ``path``; raises RuntimeError if it exits or times out first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f}s")
        time.sleep(0.02)  # polling a file for a child's readiness
