"""The tables of the ``CDB_*`` variables (the ``services.settings`` docstring), from the fields' help."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from cdb_engine.config import EngineConfig
from cdb_engine.config_source import CONFIG_ENV, env_name
from services.settings.knobs import Settings


def _default_text(value: Any) -> str:
    if value is None:
        return "auto"
    if value == "":
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def variables_table() -> str:
    """The tables of the ``services.settings`` docstring, from the fields' help."""
    head = "| variable | default | meaning |\n|---|---|---|\n"
    config = f"| ``{CONFIG_ENV}`` | (unset) | config file (TOML; YAML: .yaml/.yml) of any keys below; "
    config += "``--config`` overrides it |\n"

    def rows(record: type) -> str:
        return "".join(
            f"| ``{env_name(f.name)}`` | {_default_text(f.default)} | {f.metadata['help']} |\n" for f in fields(record)
        )

    engine_intro = (
        "The engine options, the same for the four processes of a tree (each also ``--option`` of ``cdb serve``, "
        "``cdb\nscheduler`` and ``cdb demo``; ``cdb stage`` takes ``--model``, ``--dtype`` and ``--device``):\n\n"
    )
    return head + config + rows(Settings) + "\n" + engine_intro + head + rows(EngineConfig)
