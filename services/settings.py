"""Every ``CDB_*`` environment variable of the services, read in this one place into a frozen, typed record.

| variable | default | meaning |
|---|---|---|
| ``CDB_STAGE_THREADS`` | 1 | torch intra-op threads per stage process (three stages share the host's cores) |
| ``CDB_FENCE_TIMEOUT_S`` | 30 | a stage fails a batch whose fences are not satisfied within this time |
| ``CDB_FENCE_SPIN_S`` | 0.0002 | busy-wait this long on a fence before backing off with tiny sleeps |
| ``CDB_STAGE_CONNECT_TIMEOUT_S`` | 120 | how long the scheduler waits for its stages to be ready at start |
| ``CDB_STAGE_KEEPALIVE_S`` | 5 | HTTP/2 keepalive ping interval on stage channels (a frozen stage is detected) |
| ``CDB_STAGE_PROBE_TIMEOUT_S`` | 2 | deadline of the health probe of each stage |
| ``CDB_HEALTH_INTERVAL_S`` | 0.5 | period of the scheduler's readiness check |
| ``CDB_STALL_TIMEOUT_S`` | 15 | work pending without engine progress this long: NOT_SERVING |
| ``CDB_DRAIN_TIMEOUT_S`` | 30 | SIGTERM: how long in-flight streams may finish before they are cancelled |
| ``CDB_MAX_CONCURRENT_RPCS`` | 1024 | hard cap of concurrent RPCs of the public server (RESOURCE_EXHAUSTED beyond) |
| ``CDB_READY_TIMEOUT_S`` | 180 | ``serve_all``: how long to wait for every child to become ready |
| ``CDB_UVLOOP`` | 1 | run the public server's event loop on uvloop when installed |
| ``CDB_METRICS_ADDR`` | (unset) | ``HOST:PORT`` of the scheduler's Prometheus endpoint (``:9464``: all interfaces) |
| ``CDB_CPUS`` | (unset) | pin the processes to CPUs, e.g. ``loop:1,head:0,prelude:0,scheduler:0`` (``+``: several) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from services.net import is_host_port


class SettingsError(ValueError):
    """A ``CDB_*`` variable does not parse or is out of range."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Operational knobs of the stage servers, the scheduler service and the launcher."""

    stage_threads: int = 1
    fence_timeout_s: float = 30.0
    fence_spin_s: float = 2e-4
    stage_connect_timeout_s: float = 120.0
    stage_keepalive_s: float = 5.0
    stage_probe_timeout_s: float = 2.0
    health_interval_s: float = 0.5
    stall_timeout_s: float = 15.0
    drain_timeout_s: float = 30.0
    max_concurrent_rpcs: int = 1024
    ready_timeout_s: float = 180.0
    uvloop: bool = True
    metrics_addr: str = ""
    cpus: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "cpus":
                cpu_map(value)
                continue
            if isinstance(value, str):
                if value and not is_host_port(value):
                    raise SettingsError(f"CDB_{f.name.upper()} must be HOST:PORT (or :PORT), got {value!r}")
                continue
            if f.name == "fence_spin_s":
                ok = value >= 0
            elif isinstance(value, bool):
                ok = True
            else:
                ok = value > 0
            if not ok:
                raise SettingsError(f"CDB_{f.name.upper()} must be positive, got {value}")


PROCESS_ROLES = ("prelude", "loop", "head", "scheduler")


def cpu_map(spec: str) -> dict[str, set[int]]:
    """``loop:1,head:0+1`` -> CPUs by process role; SettingsError naming the problem."""
    out: dict[str, set[int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        role, sep, cpus = part.partition(":")
        try:
            if not sep or role not in PROCESS_ROLES:
                raise ValueError
            out[role] = {int(c) for c in cpus.split("+")}
        except ValueError:
            raise SettingsError(
                f"CDB_CPUS must be ROLE:CPU[+CPU...] pairs with ROLE in {'|'.join(PROCESS_ROLES)}, got {part!r}"
            ) from None
    return out


def _parse(name: str, raw: str, kind: type) -> int | float | bool | str:
    try:
        if kind is str:
            return raw.strip()
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read ``CDB_*`` variables (default: ``os.environ``) over the defaults; raises SettingsError."""
    env = os.environ if environ is None else environ
    defaults = Settings()
    values: dict[str, int | float | bool | str] = {}
    for f in fields(Settings):
        name = f"CDB_{f.name.upper()}"
        if name in env:
            values[f.name] = _parse(name, env[name], type(getattr(defaults, f.name)))
    return Settings(**values)  # type: ignore[arg-type]
