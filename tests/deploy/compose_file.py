"""Reading docker-compose.yml without Docker: YAML load, Compose variable interpolation, override merging.

Only what our files use and the Compose Specification defines for it: ``${VAR}``, ``${VAR:-default}``,
``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``, ``${VAR:+alt}``, ``${VAR+alt}``, ``$VAR`` and the
``$$`` escape; YAML merge keys (``<<``) come with PyYAML. Overrides merge mappings recursively; a service's
``volumes`` merge by container path and its ``ports`` by value (Compose's rule for those sequences); everything
else is replaced (what Compose does for the keys our overrides set).
"""

from __future__ import annotations

import copy
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "deploy" / "docker-compose.gpu.yml"
PUBLIC_OVERRIDE = ROOT / "deploy" / "docker-compose.public.yml"
FRONTENDS_OVERRIDE = ROOT / "deploy" / "docker-compose.frontends.yml"
FRONTEND_SERVICE = "frontend"  # (FRONTENDS_OVERRIDE) the public ports' processes
LINK_DIR = "/var/lib/cdb/link"  # (FRONTENDS_OVERRIDE) the link volume: the front-end link and the scheduler's socket
COLLECTOR = ROOT / "deploy" / "otel-collector.yaml"
SCHEMA = Path(__file__).resolve().parent / "compose-spec.json"
CDB_SERVICES = ("scheduler", "prelude", "loop", "head")
STAGES = ("prelude", "loop", "head")
SECRET_SERVICE = "stage-secret"  # one-shot: writes the stage-plane secret into a shared volume
POD_SERVICE = "pod"  # holds the shared namespaces and the published ports

_VAR = re.compile(
    r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)


def load(path: Path = COMPOSE) -> dict[str, Any]:
    with open(path) as f:
        doc = yaml.safe_load(f)
    assert isinstance(doc, dict)
    return doc


def interpolate_str(text: str, env: Mapping[str, str]) -> str:
    """Compose interpolation of one string."""

    def sub(m: re.Match[str]) -> str:
        escaped, name, op, arg, bare = m.groups()
        if escaped:
            return "$"
        if bare:
            return env.get(bare, "")
        value, arg = env.get(name), interpolate_str(arg or "", env)
        if op is None:
            return value or ""
        unset_or_empty = value is None or (op.startswith(":") and value == "")
        kind = op[-1]
        if kind == "-":
            return arg if unset_or_empty else value or ""
        if kind == "?":
            if unset_or_empty:
                raise ValueError(f"required variable {name}: {arg}")
            return value or ""
        return "" if unset_or_empty else arg  # "+"

    return _VAR.sub(sub, text)


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    """Interpolate every string value (not keys) of a loaded compose document."""
    if isinstance(node, str):
        return interpolate_str(node, env)
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    return node


def _volume_target(spec: Any) -> str:
    return spec["target"] if isinstance(spec, dict) else str(spec).split(":")[1]


def merge(base: Any, override: Any, key: str = "") -> Any:
    """``override`` applied on ``base``: mappings merge recursively, ``volumes`` by container path, ``ports`` by
    value, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = copy.deepcopy(base)
        for k, value in override.items():
            out[k] = merge(out[k], value, k) if k in out else copy.deepcopy(value)
        return out
    if key == "volumes" and isinstance(base, list) and isinstance(override, list):
        targets = {_volume_target(v) for v in override}
        return [v for v in base if _volume_target(v) not in targets] + copy.deepcopy(override)
    if key == "ports" and isinstance(base, list) and isinstance(override, list):
        return copy.deepcopy(base) + [p for p in override if p not in base]
    return copy.deepcopy(override)


def command_argv(service: Mapping[str, Any]) -> list[str]:
    """A service's command as an argv (Compose splits a string command like a POSIX shell, without one)."""
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def flag_values(argv: list[str], flag: str) -> list[str]:
    """Every value of ``flag`` (``--flag VALUE`` or ``--flag=VALUE``) in ``argv``."""
    values = []
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values
