"""Each setting's value checked on its own (``problem``), and the parsers of the values that hold lists: served
model names, histogram buckets, CPUs by process role."""

from __future__ import annotations

import ipaddress
from typing import Any

from cdb_engine.config_source import SourceError
from services.net import is_host_port


class SettingsError(SourceError):
    """A ``CDB_*`` variable or a config-file key does not parse or is out of range."""


_ADDRESSES = frozenset({"metrics_addr", "http_addr"})
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
_CHOICES = {"log_level": LOG_LEVELS, "log_format": LOG_FORMATS}
_BUCKETS = frozenset({"request_latency_buckets", "token_latency_buckets"})
PROCESS_ROLES = ("prelude", "loop", "head", "scheduler", "frontend")


def value_problem(name: str, value: Any) -> str | None:
    """What is wrong with one setting's value on its own, or None."""
    if name == "served_model_name":
        return "must be names separated by commas, none empty" if value and "" in served_names(value) else None
    if name in _CHOICES:
        return None if value in _CHOICES[name] else f"must be one of {', '.join(_CHOICES[name])}"
    if name in _BUCKETS:
        try:
            parse_buckets(value)
        except ValueError as exc:
            return str(exc)
        return None
    if name == "forwarded_allow_ips":
        ok = not value or value == "*" or all(map(_is_network, value.split(",")))
        return None if ok else "must be IPs or CIDRs, or *"
    if name == "cpus":
        try:
            cpu_map(value)
        except SettingsError as exc:
            return str(exc).removeprefix("CDB_CPUS ")
        return None
    if isinstance(value, str):
        return "must be HOST:PORT (or :PORT)" if name in _ADDRESSES and value and not is_host_port(value) else None
    if isinstance(value, bool):
        return None
    if value is None:  # auto
        return None
    if name in ("fence_spin_s", "throughput_log_interval_s", "frontends"):
        return None if value >= 0 else "must be >= 0"
    return None if value > 0 else "must be positive"


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        return False
    return True


def served_names(spec: str) -> list[str]:
    """``a, b`` -> ``["a", "b"]``: the model names of ``CDB_SERVED_MODEL_NAME`` (``--served-model-name``), the first
    the one reported; [] for an empty spec (the API serves the model under its ``--model``)."""
    return [name.strip() for name in spec.split(",")] if spec.strip() else []


def parse_buckets(spec: str) -> tuple[float, ...]:
    """``0.1,1,10`` -> histogram bucket upper bounds (seconds, increasing, positive); () for an empty spec (the
    built-in buckets); ValueError naming the problem."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    try:
        bounds = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"must be comma-separated numbers of seconds, got {spec!r}") from None
    if any(not b > 0 or b == float("inf") for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise ValueError(f"must be finite positive bounds in increasing order, got {spec!r}")
    return bounds


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
