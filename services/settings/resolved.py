"""``Resolved``: the whole configuration a process runs with, and the JSON document a launcher hands its children."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields
from typing import Any

from cdb_engine.config import EngineConfig
from services.settings.checks import SettingsError
from services.settings.knobs import Settings

HIDDEN = "(hidden)"  # a secret's value as Info shows it


@dataclass(frozen=True, slots=True)
class Resolved:
    """The whole configuration a process runs with, resolved once (flags > ``CDB_*`` > config file > defaults).

    ``to_json`` is the document the launcher hands its children (secrets included: written 0600); ``shown`` is
    what ``Info`` reports (secrets hidden) and ``digest`` its SHA-256, equal across the processes of a tree."""

    settings: Settings
    engine: EngineConfig

    def _values(self, hide: bool) -> dict[str, dict[str, Any]]:
        def record(obj: Any) -> dict[str, Any]:
            out = {}
            for f in fields(obj):
                value = getattr(obj, f.name)
                out[f.name] = HIDDEN if hide and not f.repr and value else value  # repr=False: a secret
            return out

        return {"engine": record(self.engine), "settings": record(self.settings)}

    def to_json(self) -> str:
        return json.dumps(self._values(hide=False), sort_keys=True)

    def shown(self) -> str:
        """The values as JSON (keys sorted, one line), secrets replaced by ``(hidden)``."""
        return json.dumps(self._values(hide=True), sort_keys=True)

    def digest(self) -> str:
        """SHA-256 (hex) of ``shown()``."""
        return hashlib.sha256(self.shown().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str, where: str = "the resolved configuration") -> Resolved:
        """The record of ``to_json``'s document; SettingsError naming ``where`` when it is not one."""
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or set(doc) != {"engine", "settings"}:
                raise ValueError("want an object of 'engine' and 'settings'")
            return cls(Settings(**doc["settings"]), EngineConfig(**doc["engine"]))
        except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError; TypeError: a key that is no field
            raise SettingsError(f"{where}: not a resolved configuration ({exc})") from None

    def write(self, path: str) -> None:
        """Write ``to_json()`` to ``path``, readable by its owner only (it holds the secrets)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.to_json())

    @classmethod
    def read(cls, path: str) -> Resolved:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise SettingsError(f"--resolved-config={path!r}: {exc.strerror or exc}") from None
        return cls.from_json(text, path)
