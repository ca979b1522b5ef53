"""The model a user names (``cdb serve MODEL``, ``--model``, ``CDB_MODEL``): a preset, a shipped model, a checkpoint
folder, or a Hugging Face hub id (``ORG/NAME``) already in the local Hugging Face cache. The network is never
used: a hub id that is not in the cache is a one-line error naming the cache folder searched.

A hub id is looked up by ``huggingface_hub`` itself (``snapshot_download(..., local_files_only=True)``: the main
branch's snapshot, never the network); a cache holding one snapshot of another revision and no ``refs/main`` (a
download of that revision) serves that snapshot. The cache is huggingface_hub's documented layout, found as
huggingface_hub finds it: ``$HF_HUB_CACHE``, else
``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub``. A model ``ORG/NAME`` lives in ``models--ORG--NAME/``: ``refs/main`` holds the commit
of its main branch and ``snapshots/<commit>/`` the files of that commit (what ``hf download ORG/NAME`` leaves).
A local folder of the same name wins over the cache (the name is tried as a path first).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cdb_model.loader import is_preset

# huggingface_hub's repo id: ORG/NAME, each of letters, digits and ``-_.`` (not starting with ``-`` or ``.``).
_HUB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_][A-Za-z0-9_.-]*")


class ModelNotFoundError(ValueError):
    """A hub id that is neither a local folder nor in the local Hugging Face cache (one line)."""


@dataclass(frozen=True)
class ModelSource:
    """``name``: the model as the user named it (the default name the API serves it under); ``path``: what the
    loader reads (the name itself, or the cache snapshot folder of a hub id)."""

    name: str
    path: str

    @property
    def from_cache(self) -> bool:
        return self.path != self.name


def hub_cache(environ: Mapping[str, str] | None = None) -> Path:
    """The local Hugging Face hub cache folder (``environ``: default ``os.environ``), as huggingface_hub finds it."""
    env = os.environ if environ is None else environ

    def expand(path: str) -> Path:
        return Path(os.path.expanduser(os.path.expandvars(path)))

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return expand(env[var])
    if env.get("HF_HOME"):
        return expand(env["HF_HOME"]) / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return expand(xdg) / "huggingface" / "hub"


def is_hub_id(source: str) -> bool:
    """``ORG/NAME``, the shape of a Hugging Face model id."""
    return _HUB_ID.fullmatch(source) is not None and ".." not in source


def resolve_model(source: str, environ: Mapping[str, str] | None = None) -> ModelSource:
    """Where the loader finds ``source``: a preset name, an existing path, or anything not shaped like a hub id is
    returned as it is (the loader and the preflight judge it); a hub id is looked up in the local cache. Raises
    ``ModelNotFoundError`` (one line naming the cache folder) when it is not there."""
    if is_preset(source) or Path(source).exists() or not is_hub_id(source):
        return ModelSource(source, source)
    cache = hub_cache(environ)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return ModelSource(source, snapshot_download(source, cache_dir=str(cache), local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not there as the main branch: one snapshot of another revision, or nothing (below)
    repo = cache / ("models--" + source.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():  # the commit of the main branch, as the download left it
        found = [snapshots / ref.read_text().strip()]
    else:  # a download of one other revision: its only snapshot
        found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) > 1:
        raise ModelNotFoundError(
            f"--model {source}: {repo} holds {len(found)} snapshots and no refs/main; "
            f"name one of them as --model, e.g. {found[0]}"
        )
    if not found or not found[0].is_dir():
        raise ModelNotFoundError(
            f"--model {source}: no such folder, and not in the Hugging Face cache {cache} (no {repo.name} snapshot "
            f"there); cdb never downloads: fetch it first, e.g. hf download {source}"
        )
    return ModelSource(source, str(found[0]))
