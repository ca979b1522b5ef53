"""Reading docker-compose.yml without Docker: YAML load, Compose variable interpolation, override merging.

Only what our files use and the Compose Specification defines for it: ``${VAR}``, ``${VAR:-default}``,
``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``, ``${VAR:+alt}``, ``${VAR+alt}``, ``$VAR`` and the
``$$`` escape; YAML merge keys (``<<``) come with PyYAML. Overrides merge mappings recursively and replace
everything else (what Compose does for the keys our override sets).
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
COLLECTOR = ROOT / "deploy" / "otel-collector.yaml"
SCHEMA = Path(__file__).resolve().parent / "compose-spec.json"
CDB_SERVICES = ("scheduler", "prelude", "loop", "head")
STAGES = ("prelude", "loop", "head")

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


def merge(base: Any, override: Any) -> Any:
    """``override`` applied on ``base``: mappings merge recursively, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = copy.deepcopy(base)
        for key, value in override.items():
            out[key] = merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
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
