"""``EngineConfig`` as command-line options: one ``--option`` per field.

Every process of the tree takes the same engine options (``add_engine_args``): each one's help is its field's
``metadata["help"]``, its default the value the settings source gives (``CDB_<FIELD>``, the config file, else the
field's default; ``cdb_engine.config_source``), its choices the field's enum. A ``None`` default is spelt ``auto``
(the model's own value). A command lays its options over its source once (``cdb.processes.resolve_command``); a
launcher hands its children the result as one document, not as options.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cdb_engine.config import EngineConfig
from cdb_engine.config_source import AUTO, engine_source

_HINTS = typing.get_type_hints(EngineConfig)
FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def field_kind(name: str) -> tuple[type, bool]:
    """A field's value type (a ``StrEnum``, bool, int, float or str) and whether ``None`` (``auto``) is allowed."""
    hint = _HINTS[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    assert len(kinds) == 1 and isinstance(kinds[0], type), f"EngineConfig.{name}: one type (or None) per field"
    return kinds[0], len(kinds) < len(args)


def field_help(name: str) -> str:
    """The one help text of an engine field (its option, its ``CDB_*`` variable, its config-file key)."""
    return str(FIELDS[name].metadata["help"])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flags(name: str) -> tuple[str, ...]:
    """A field's option and its aliases (``--max-total-tokens``, ``--max-model-len``)."""
    return (_flag(name), *FIELDS[name].metadata.get("aliases", ()))


def _choice_type(kind: type[enum.StrEnum], sentinel: str | None) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if sentinel is not None and text.lower() == sentinel:
            return sentinel
        try:
            return kind(text)
        except ValueError:
            return text  # not a choice: argparse's "invalid choice" error lists them

    convert.__name__ = kind.__name__
    return convert


def auto_or(kind: type) -> Callable[[str], Any]:
    """An argparse type: ``kind``, or None for ``auto``."""

    def convert(text: str) -> Any:
        return None if text.lower() == AUTO else kind(text)

    convert.__name__ = kind.__name__  # argparse's error: "invalid int value: 'x'"
    return convert


def add_engine_args(
    parser: argparse.ArgumentParser,
    defaults: Mapping[str, Any] | None = None,
    *,
    only: Iterable[str] | None = None,
) -> None:
    """One ``--option`` per ``EngineConfig`` field (``max_num_seqs`` -> ``--max-num-seqs``), or the fields in
    ``only``. ``defaults``: the options' defaults over the fields' own (None: what the settings source of this
    process's environment sets, ``cdb_engine.config_source.engine_source()``; raises its ``SourceError``)."""
    given = engine_source().values if defaults is None else defaults
    group = parser.add_argument_group(
        "engine", "each option is also CDB_<OPTION> and a config-file key (services/settings.py)"
    )
    for name in FIELDS if only is None else only:
        kind, optional = field_kind(name)
        field_default = FIELDS[name].default
        value = given.get(name, field_default)
        help_ = field_help(name)
        if kind is bool:
            group.add_argument(*_flags(name), action=argparse.BooleanOptionalAction, default=value, help=help_)
        elif issubclass(kind, enum.StrEnum):
            sentinel = field_default if isinstance(field_default, str) and field_default not in set(kind) else None
            choices = [m.value for m in kind] + ([sentinel] if sentinel else [])  # strings: readable errors
            group.add_argument(
                *_flags(name), type=_choice_type(kind, sentinel), choices=choices, default=value, help=help_
            )
        elif optional:
            default = AUTO if value is None else value  # argparse converts a string default: auto -> None
            group.add_argument(
                *_flags(name),
                type=auto_or(kind),
                default=default,
                metavar=f"{kind.__name__.upper()}|{AUTO}",
                help=help_,
            )
        else:
            plain = None if kind is str else kind.__name__.upper()  # a string: the option's name (--model MODEL)
            group.add_argument(*_flags(name), type=kind, default=value, metavar=plain, help=help_)
