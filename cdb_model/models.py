"""Model class dispatch by architecture."""

from __future__ import annotations

from collections.abc import Iterable

from cdb_model.base import LoopedLM
from cdb_model.config import ModelConfig
from cdb_model.huginn import HuginnLM
from cdb_model.ouro import OuroLM
from cdb_scheduler.plan import Stage


def build_model(config: ModelConfig, stages: Iterable[Stage] | None = None) -> LoopedLM:
    """The model for ``config.arch`` holding ``stages`` (None: all). Parameters are left uninitialised by
    intent only when constructed under ``torch.device("meta")``; the loaders then assign real tensors."""
    return OuroLM(config, stages) if config.arch == "ouro" else HuginnLM(config, stages)
