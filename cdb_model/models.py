"""Model class dispatch by architecture, and the empty build the loaders fill."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from cdb_model.base import LoopedLM
from cdb_model.config import ModelConfig
from cdb_model.huginn import HuginnLM
from cdb_model.ouro import OuroLM
from cdb_scheduler.plan import Stage


def build_model(config: ModelConfig, stages: Iterable[Stage] | None = None) -> LoopedLM:
    """The model for ``config.arch`` holding ``stages`` (None: all), its parameters initialised as torch's modules
    do (use ``build_empty`` for a model whose tensors are assigned afterwards)."""
    return OuroLM(config, stages) if config.arch == "ouro" else HuginnLM(config, stages)


# torch's random and constant fills: on the meta device each returns its tensor untouched (it holds no values).
_FILLS = frozenset({"normal_", "uniform_", "zero_", "fill_", "random_", "exponential_", "bernoulli_", "erfinv_"})


class _NoMetaFills(TorchFunctionMode):
    """Inside, a fill of a meta tensor returns at once: a module's ``reset_parameters`` costs nothing. (Run, some of
    them, ``normal_`` first, call torch's Python reference kernels, whose first use imports sympy and the
    decompositions: about 1.5 s of a stage process's start.) Function modes are per thread: nothing else changes."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # (``torch.nn.init`` passes it by name)
        if getattr(func, "__name__", "") in _FILLS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def build_empty(config: ModelConfig, stages: Iterable[Stage] | None = None) -> LoopedLM:
    """``build_model`` on the meta device without initialising anything: the shapes and names, no memory, no
    values; the loaders assign the real tensors (``load_state_dict(..., assign=True)``)."""
    with torch.device("meta"), _NoMetaFills():
        return build_model(config, stages)
