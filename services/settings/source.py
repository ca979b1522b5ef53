"""A process's configuration read from its source, once: the ``CDB_*`` variables over the config file over the
defaults (``load_configuration``), or the document a launcher handed it (``handed_configuration``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cdb_engine.config import EngineConfig
from cdb_engine.config_source import ENGINE_FIELDS, SourceError, SourceValues, check_engine_field, read_source
from services.settings.checks import SettingsError, value_problem
from services.settings.knobs import SETTINGS_FIELDS, Settings
from services.settings.resolved import Resolved


def _check(name: str, value: Any) -> None:
    if name in ENGINE_FIELDS:
        check_engine_field(name, value)
    elif problem := value_problem(name, value):
        raise ValueError(problem)


@dataclass(frozen=True)
class Configuration:
    """One process's configuration from the source: its ``settings`` and the engine fields the environment or
    the config file set (``engine``: the defaults of its engine flags; ``origins``: where each value came from)."""

    settings: Settings
    engine: Mapping[str, Any]
    origins: Mapping[str, str]
    config_file: str | None

    def engine_config(self, **flags: Any) -> EngineConfig:
        """``EngineConfig`` of the source's values with ``flags`` over them."""
        return EngineConfig(**{**self.engine, **flags})


def load_configuration(environ: Mapping[str, str] | None = None, config_file: str | None = None) -> Configuration:
    """Read the ``CDB_*`` variables (default: ``os.environ``) over the config file (``config_file``, else
    ``CDB_CONFIG``) over the defaults, every service and engine field; SettingsError naming a bad value. Cached
    (a process reads them once): the same environment and file give the same result."""
    try:
        source = read_source((Settings, EngineConfig), environ, config_file, check=_check)
        known = _CONFIGURATIONS.get(id(source))
        if known is not None and known[0] is source:
            return known[1]
        settings = Settings(**source.subset(SETTINGS_FIELDS))
    except SettingsError:
        raise
    except SourceError as exc:
        raise SettingsError(str(exc)) from None
    conf = Configuration(settings, source.subset(ENGINE_FIELDS), source.origins, source.config_file)
    _CONFIGURATIONS[id(source)] = (source, conf)
    return conf


_CONFIGURATIONS: dict[int, tuple[SourceValues, Configuration]] = {}  # read_source's results (cached) -> ours


def load_settings(environ: Mapping[str, str] | None = None, config_file: str | None = None) -> Settings:
    """The services' settings from ``CDB_*`` variables (default: ``os.environ``) and the config file over the
    defaults; raises SettingsError (also for a bad engine value: the source is validated whole)."""
    return load_configuration(environ, config_file).settings


def handed_configuration(path: str) -> Configuration:
    """The configuration a launcher handed this process (``--resolved-config FILE``, ``Resolved.write``): the
    whole source under the process's flags; the environment and config files are not read."""
    resolved = Resolved.read(path)
    engine = {name: getattr(resolved.engine, name) for name in ENGINE_FIELDS}
    return Configuration(resolved.settings, engine, dict.fromkeys([*SETTINGS_FIELDS, *ENGINE_FIELDS], path), None)
