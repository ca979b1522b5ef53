"""The server's version, one source for ``cdb --version``, the gRPC ``Info`` reply and ``GET /version``.

A source checkout reports its ``pyproject.toml`` (the truth of the tree being run, even if an older build is
installed); an installed package without its source reports the installed distribution's metadata.
"""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

DISTRIBUTION = "cdb"
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@functools.cache
def server_version() -> str:
    """``0.1.0``: the version of the ``cdb`` distribution this code belongs to."""
    try:
        project = tomllib.loads(_PYPROJECT.read_text())["project"]
        if project.get("name") == DISTRIBUTION:
            return str(project["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        pass  # no source tree around this package: an installed copy
    return importlib.metadata.version(DISTRIBUTION)
