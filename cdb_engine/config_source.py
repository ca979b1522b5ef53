"""The one typed settings source of a deployment, on pydantic-settings. A field's value comes from, highest first:

1. its command-line option, where the process has one (``--max-num-seqs 16``);
2. its environment variable ``CDB_<FIELD>`` (``CDB_MAX_NUM_SEQS=16``);
3. the config file named by ``--config FILE`` or ``CDB_CONFIG`` (TOML; YAML when it ends in ``.yaml``/``.yml``),
   key ``<field>`` (``max_num_seqs = 16``; ``max-num-seqs`` too);
4. the built-in default: the field's default in its record.

The records are frozen dataclasses (``EngineConfig``; ``services.settings.Settings`` adds the operational knobs);
each field's type comes from its annotation. ``auto`` spells a ``None`` default (the model's own value) and
``EngineConfig.dtype``'s device rule. ``read_source`` validates the file and the environment together and returns
what they set; the entry points lay their flags over it (``cdb_engine.options``: those values are the flags'
defaults). A process reads them once: results are cached on the environment's ``CDB_*`` items and the file's
identity (path, size, mtime). A bad value is a ``SourceError``: one line naming the variable, or the file and key,
and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationError, create_model
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)
from pydantic_settings.sources.utils import parse_env_vars

from cdb_engine.config import EngineConfig

CONFIG_ENV = "CDB_CONFIG"
ENV_PREFIX = "CDB_"
AUTO = "auto"
YAML_SUFFIXES = (".yaml", ".yml")

# What a pydantic error type means, in the words of the one line a user gets.
_PROBLEMS = {
    "int_parsing": "not an integer",
    "int_type": "not an integer",
    "int_from_float": "not an integer",
    "float_parsing": "not a number",
    "float_type": "not a number",
    "bool_parsing": "not a boolean (true/false, yes/no, on/off, 1/0)",
    "bool_type": "not a boolean (true/false, yes/no, on/off, 1/0)",
    "string_type": "not a string",
}


class SourceError(ValueError):
    """A variable or a config-file key does not parse or is out of range (one line naming it)."""


def env_name(field: str) -> str:
    """The environment variable of a field: ``max_num_seqs`` -> ``CDB_MAX_NUM_SEQS``."""
    return ENV_PREFIX + field.upper()


@dataclasses.dataclass(frozen=True)
class SourceValues:
    """What the environment and the config file set (typed, validated); fields they leave out are absent."""

    values: Mapping[str, Any] = dataclasses.field(repr=False)  # may hold secrets (CDB_STAGE_SECRET)
    origins: Mapping[str, str] = dataclasses.field(
        default_factory=dict
    )  # field -> where its value came from: "CDB_MAX_NUM_SEQS" or "FILE: max_num_seqs"
    config_file: str | None = None  # the file read (absolute), if any

    def subset(self, names: typing.Iterable[str]) -> dict[str, Any]:
        wanted = set(names)
        return {k: v for k, v in self.values.items() if k in wanted}


class _Source(BaseSettings):
    """The typed record the layers are validated into; its fields are made from the records' fields."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=False, extra="forbid", str_strip_whitespace=True, frozen=True
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # read_source reads each layer itself (the environment from a given mapping, the file it was named), so
        # that an error can name the layer it came from; the model only validates their merge.
        return (init_settings,)


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


def _auto_none(value: Any) -> Any:
    return None if isinstance(value, str) and value.strip().lower() == AUTO else value


def _choice(kind: type[enum.StrEnum], sentinel: str | None, value: Any) -> Any:
    """``value`` as a member of ``kind`` (or the ``auto`` sentinel); ValueError listing the choices otherwise."""
    text = str(value).strip() if isinstance(value, str | enum.Enum) else value
    if sentinel is not None and isinstance(text, str) and text.lower() == sentinel:
        return sentinel
    try:
        return kind(text)
    except ValueError:
        allowed = [m.value for m in kind] + ([sentinel] if sentinel else [])
        raise ValueError(f"must be one of {', '.join(allowed)}") from None


def _annotation(hint: Any, default: Any) -> Any:
    """The pydantic type of a record field: its annotation, with ``auto`` for a ``None`` default."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kind = next(a for a in args if a is not type(None))
    optional = len(args) > 1
    if isinstance(kind, type) and issubclass(kind, enum.StrEnum):
        sentinel = default if isinstance(default, str) and default not in set(kind) else None
        validator = BeforeValidator(functools.partial(_choice, kind, sentinel))
        base: Any = kind if sentinel is None else typing.Union[kind, typing.Literal[sentinel]]  # noqa: UP007
        return Annotated[base | None if optional else base, validator]
    if optional:
        return Annotated[kind | None, BeforeValidator(_auto_none)]
    return kind


@functools.cache
def _model(records: tuple[type, ...]) -> type[_Source]:
    fields: dict[str, Any] = {}
    for record in records:
        hints = typing.get_type_hints(record)
        for f in dataclasses.fields(record):
            fields[f.name] = (_annotation(hints[f.name], f.default), f.default)
    return create_model("CdbSource", __base__=_Source, **fields)


def _read_file(model: type[_Source], path: str, named_by: str) -> dict[str, Any]:
    """The config file's top-level mapping, keys normalised (``max-num-seqs`` -> ``max_num_seqs``)."""
    if not Path(path).is_file():
        raise SourceError(f"{named_by}={path!r}: no such file")
    yaml_file = path.endswith(YAML_SUFFIXES)
    try:
        if yaml_file:
            data: Any = YamlConfigSettingsSource(model, yaml_file=path).yaml_data
        else:
            data = TomlConfigSettingsSource(model, toml_file=path).toml_data
    except Exception as exc:  # tomllib / yaml parse errors, unreadable files: one line naming the file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SourceError(f"{path}: not a valid {'YAML' if yaml_file else 'TOML'} file: {first}") from None
    if not isinstance(data, dict):
        raise SourceError(f"{path}: a config file is a table of keys (max_num_seqs = 16, ...)")
    return {str(k).replace("-", "_").lower(): v for k, v in data.items()}


_FILES: dict[tuple[str, int, int], dict[str, Any]] = {}
_RESULTS: dict[tuple[Any, ...], SourceValues] = {}


def _file_values(model: type[_Source], path: str, named_by: str) -> dict[str, Any]:
    """The parsed file, read once per process while it stays the same file."""
    try:
        st = os.stat(path)
    except OSError:
        return _read_file(model, path, named_by)  # raises the one-line error
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _FILES:
        _FILES[key] = _read_file(model, path, named_by)
    return dict(_FILES[key])


def _problem(error: Mapping[str, Any]) -> str:
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    return _PROBLEMS.get(error["type"], str(error["msg"]))


def read_source(
    records: tuple[type, ...],
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
    *,
    check: Callable[[str, Any], None] | None = None,
    strict: bool = True,
) -> SourceValues:
    """The values that the environment (default ``os.environ``) and the config file set for the fields of
    ``records``. ``config_file`` (``--config``) names the file over ``CDB_CONFIG``. ``check(name, value)`` raises
    ValueError (message: the field's name, then the problem) for a value its record refuses. ``strict``: a file
    key that is no field is an error (a partial read, ``strict=False``, skips it)."""
    env = os.environ if environ is None else environ
    named_by = "--config" if config_file else CONFIG_ENV
    path = config_file or env.get(CONFIG_ENV) or None
    model = _model(records)
    file_values = _file_values(model, path, named_by) if path else {}
    key = (
        records,
        tuple(sorted((k, v) for k, v in env.items() if k.upper().startswith(ENV_PREFIX))),
        path and os.path.abspath(path),
        repr(sorted(file_values.items())),
        check,
        strict,
    )
    if key not in _RESULTS:
        _RESULTS[key] = _resolve(model, env, path, file_values, check, strict)
    return _RESULTS[key]


def _resolve(
    model: type[_Source],
    env: Mapping[str, str],
    path: str | None,
    file_values: dict[str, Any],
    check: Callable[[str, Any], None] | None,
    strict: bool,
) -> SourceValues:
    names = list(model.model_fields)
    unknown = [k for k in file_values if k not in model.model_fields]
    if unknown and strict:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"; did you mean {close[0]}?" if close else " (services/settings.py lists every key)"
        raise SourceError(f"{path}: unknown key {unknown[0]!r}{hint}")
    env_values = _MappingEnvSource(model, env)()
    data = {k: v for k, v in file_values.items() if k in model.model_fields}
    origins = {k: f"{path}: {k}" for k in data}
    data.update(env_values)
    origins.update({k: env_name(k) for k in env_values})

    def where(name: str) -> str:
        raw = data[name]
        return f"{env_name(name)}={raw!r}" if name in env_values else f"{path}: {name} = {raw!r}"

    try:
        validated = model(**data)
    except ValidationError as exc:
        errors = sorted(exc.errors(), key=lambda e: names.index(str(e["loc"][0])))
        first = errors[0]
        more = len({e["loc"][0] for e in errors}) - 1
        tail = f" (and {more} more)" if more else ""
        raise SourceError(f"{where(str(first['loc'][0]))}: {_problem(first)}{tail}") from None
    values = {name: getattr(validated, name) for name in names if name in data}
    for name, value in values.items():
        try:
            if check is not None:
                check(name, value)
        except ValueError as exc:
            text = str(exc)
            for prefix in (f"{name} ", f"{env_name(name)} "):
                text = text.removeprefix(prefix)
            raise SourceError(f"{where(name)}: {text}") from None
    return SourceValues(values, origins, path and os.path.abspath(path))


ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def check_engine_field(name: str, value: Any) -> None:
    """ValueError when ``EngineConfig`` refuses ``value`` for field ``name`` (the others at their defaults)."""
    if name in ENGINE_FIELDS:
        EngineConfig(**{name: value})


def engine_source(environ: Mapping[str, str] | None = None, config_file: str | None = None) -> SourceValues:
    """The engine fields that the environment and the config file set (other keys of the file are skipped)."""
    return read_source((EngineConfig,), environ, config_file, check=check_engine_field, strict=False)
