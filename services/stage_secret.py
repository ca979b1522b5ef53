"""The stage plane's shared secret: one per deployment, required on every ``cdb.v1.Stage`` RPC.

The launcher makes one per process tree (``create_secret_file`` in its private work dir); compose and Kubernetes
mount one from a 0600 file or a Secret (``cdb secret --out FILE`` makes it). Every process reads it with
``load_stage_secret``: ``CDB_STAGE_SECRET_FILE`` (preferred) or ``CDB_STAGE_SECRET``. It travels as
``authorization: Bearer <secret>`` call metadata and is compared in constant time (``secret_matches``).

Front-end processes do not hold it: they face the public, and one taken over would control every stage. They hold
the front-end link's secret (``link_secret``: an HMAC of the stage secret, which it does not reveal), from
``CDB_LINK_SECRET_FILE`` (``cdb serve`` gives its front ends only that; ``cdb secret --link-out FILE`` writes one
beside the stage secret for compose and Kubernetes), and the scheduler derives the same from its stage secret
(``load_link_secret``; a front end given the stage secret instead derives it too).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from services.settings import Settings, SettingsError

METADATA_KEY = "authorization"
_SCHEME = "Bearer "
_MIN_LENGTH = 16


def create_secret_file(path: str | os.PathLike[str]) -> bool:
    """Write a fresh random secret to ``path`` (mode 0600) unless the file exists; True if it was created."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return True


def write_secret_file(path: str | os.PathLike[str], value: str) -> None:
    """Write ``value`` to ``path`` (mode 0600), replacing it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def link_secret(stage_secret: str) -> str:
    """The front-end link's secret for a deployment's stage secret (which it does not reveal)."""
    return hmac.new(stage_secret.encode(), b"cdb front-end link", hashlib.sha256).hexdigest()


def load_link_secret(settings: Settings) -> str:
    """The front-end link's secret: ``CDB_LINK_SECRET_FILE``'s, else derived from the stage secret."""
    if settings.link_secret_file:
        value = _read_secret_file(settings.link_secret_file, "CDB_LINK_SECRET_FILE")
        if len(value) < _MIN_LENGTH:
            raise SettingsError(f"CDB_LINK_SECRET_FILE: the secret must be at least {_MIN_LENGTH} characters")
        return value
    if not (settings.stage_secret_file or settings.stage_secret):
        raise SettingsError(
            "no front-end link secret: set CDB_LINK_SECRET_FILE (made by `cdb secret --out STAGE --link-out FILE`)"
        )
    return link_secret(load_stage_secret(settings))


def _read_secret_file(name: str, variable: str) -> str:
    path = Path(name)
    try:
        mode = path.stat().st_mode
        value = path.read_text().strip()
    except OSError as exc:
        raise SettingsError(f"{variable}={path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and not _mounted_secret(path):
        raise SettingsError(f"{variable}={path} is readable by others (mode {mode & 0o777:o}): chmod 600")
    return value


def load_stage_secret(settings: Settings) -> str:
    """The deployment's stage secret; SettingsError (one line naming the variable) if absent or unusable."""
    if settings.stage_secret_file:
        value = _read_secret_file(settings.stage_secret_file, "CDB_STAGE_SECRET_FILE")
    else:
        value = settings.stage_secret.strip()
    if not value:
        raise SettingsError(
            "no stage secret: set CDB_STAGE_SECRET_FILE to a 0600 file (make one with `cdb secret --out FILE`)"
        )
    if len(value) < _MIN_LENGTH:
        raise SettingsError(f"the stage secret must be at least {_MIN_LENGTH} characters")
    return value


def _mounted_secret(path: Path) -> bool:
    """Kubernetes and compose secrets are mounted read-only by the runtime with modes we do not control (often
    0444 on a tmpfs only the pod sees): accept those under the usual mount points."""
    return any(str(path).startswith(prefix) for prefix in ("/run/secrets/", "/var/run/secrets/", "/etc/cdb/"))


def call_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The metadata a stage client sends with every call."""
    return ((METADATA_KEY, _SCHEME + secret),)


def secret_matches(secret: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Constant-time check of a call's ``authorization`` metadata against ``secret``."""
    presented = ""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            presented = value.decode(errors="replace") if isinstance(value, bytes) else value
    token = presented[len(_SCHEME) :] if presented.startswith(_SCHEME) else ""
    return hmac.compare_digest(token.encode(), secret.encode())
