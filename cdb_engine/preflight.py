"""Pre-flight of a whole configuration: one clear line before any process starts.

``cdb serve`` (and anything else that starts stage processes) calls ``check_config`` first, so that a bad model
path, an unknown preset, a missing weights shard, a device that is not there or exit settings the model refuses
fail at once with one line, instead of as a child's traceback after the others have started. Nothing here reads
weights or creates a CUDA context.
"""

from __future__ import annotations

import re
from pathlib import Path

from cdb_engine import hardware
from cdb_engine.config import EngineConfig
from cdb_engine.limits import resolve_limits
from cdb_engine.memory import MemoryPlanError, sized
from cdb_model.config import CheckpointError
from cdb_model.loader import check_source

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class ConfigError(ValueError):
    """A configuration that cannot serve; the message is one line naming the option and the problem."""


def check_config(config: EngineConfig) -> EngineConfig:
    """Check the model source (preset name, shipped model, or checkpoint folder: config, weight files, generation
    and tokenizer configs), the device (well-formed and present), the exit and KV settings against the model and
    the memory plan (``cdb_engine.memory``); return ``config`` with its KV pool sized. Raises ``ConfigError`` with a
    one-line message. An unknown dtype or other choice already fails when the
    ``EngineConfig`` is built (``ValueError`` naming the option and the choices)."""
    if not _DEVICE.fullmatch(config.device):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N; got {config.device!r}")
    try:
        model = check_source(config.model)
    except CheckpointError as exc:
        raise ConfigError(f"--model {config.model}: {_one_line(exc)}") from None
    if config.device.startswith("cuda"):
        count = len(hardware.cuda_memory())  # (the driver's count: no CUDA context in this process)
        index = hardware.device_index(config.device)
        if index >= count:
            found = f"{count} CUDA device(s)" if count else "no CUDA device"
            raise ConfigError(f"--device {config.device}: this machine has {found}")
    if config.tokenizer and not _has_tokenizer(Path(config.tokenizer).expanduser()):
        raise ConfigError(f"--tokenizer {config.tokenizer}: no tokenizer.json or tokenizer_config.json there")
    try:
        resolve_limits(config, model)
        return sized(config, model)
    except (ValueError, MemoryPlanError) as exc:
        raise ConfigError(_one_line(exc)) from None


def _has_tokenizer(path: Path) -> bool:
    return path.is_file() or (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
