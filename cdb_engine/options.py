"""``EngineConfig`` <-> command-line options: one ``--option`` per field, both directions.

Every process of the tree takes the same engine options (``add_engine_args``); the launcher passes a config to a
child as the options that reproduce it (``engine_config_to_argv``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any

from cdb_engine.config import EngineConfig

_HINTS = typing.get_type_hints(EngineConfig)


def _field_kind(f: dataclasses.Field[Any]) -> type | None:
    """The option's value type: a ``StrEnum`` (choices), bool, int, float or str; None: not an option."""
    hint = _HINTS[f.name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    return kinds[0] if len(kinds) == 1 and isinstance(kinds[0], type) else None


def _flag(f: dataclasses.Field[Any]) -> str:
    return "--" + f.name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--option`` per ``EngineConfig`` field (``max_num_seqs`` -> ``--max-num-seqs``)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        kind = _field_kind(f)
        if kind is None:
            continue
        if kind is bool:
            group.add_argument(_flag(f), action=argparse.BooleanOptionalAction, default=None)
        elif issubclass(kind, enum.StrEnum):
            group.add_argument(_flag(f), type=kind, choices=list(kind), default=None)
        else:
            group.add_argument(_flag(f), type=kind, default=None, metavar=kind.__name__.upper())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """``EngineConfig`` from ``add_engine_args`` options (unset options keep the defaults)."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if getattr(args, f.name, None) is not None
    }
    return EngineConfig(**values)


def engine_config_to_argv(config: EngineConfig) -> list[str]:
    """The options that reproduce ``config`` (fields equal to the default are left out)."""
    default = EngineConfig()
    argv: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value == getattr(default, f.name) or value is None or _field_kind(f) is None:
            continue
        if isinstance(value, bool):
            argv.append(_flag(f) if value else "--no-" + _flag(f)[2:])
        else:
            argv += [_flag(f), repr(value) if isinstance(value, float) else str(value)]
    return argv
