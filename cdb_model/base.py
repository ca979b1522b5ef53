"""``LoopedLM``: the stage API shared by Ouro and Huginn, used by the stage workers and the reference path.

Bank rows are ``[N, bank_width]`` (Ouro: the normed hidden state; Huginn: ``[state | injection]``). A model
built for a subset of stages holds only those stages' weights; calling another stage raises
``StageNotLoadedError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from cdb_model.attention import KVAccess
from cdb_model.config import ModelConfig
from cdb_scheduler.plan import Stage

ALL_STAGES: frozenset[Stage] = frozenset(Stage)


class StageNotLoadedError(RuntimeError):
    """A stage method was called on a model built without that stage's weights."""


class LoopedLM(nn.Module, ABC):
    """A looped LM split into PRELUDE (embed), LOOP (one step of the shared block) and HEAD (coda + LM head)."""

    def __init__(self, config: ModelConfig, stages: Iterable[Stage] | None = None) -> None:
        super().__init__()
        self.config = config
        self.stages: frozenset[Stage] = ALL_STAGES if stages is None else frozenset(stages)

    def _require(self, stage: Stage) -> None:
        if stage not in self.stages:
            raise StageNotLoadedError(
                f"{self.config.name}: stage {stage.name} was not loaded (stages: {sorted(s.name for s in self.stages)})"
            )

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def fuse_projections(self) -> None:
        """For inference: projections that read the same input (Ouro's q/k/v, gate/up) become one matmul each.
        Parameters keep their names and storage (views into the fused weight); call after loading and placing."""
        for module in self.modules():
            fuse = getattr(module, "fuse", None)
            if fuse is not None and module is not self:
                fuse()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @abstractmethod
    def prelude(self, token_ids: Tensor, positions: Tensor, kv: KVAccess | None, init_seeds: Sequence[int]) -> Tensor:
        """Token ids ``[N]`` at ``positions [N]`` -> bank rows ``[N, bank_width]``.

        Huginn: ``init_seeds[i] < 0`` gives a zero initial state, otherwise the seeded truncated normal.
        """

    @abstractmethod
    def loop_step(
        self, rows: Tensor, positions: Tensor, steps: Tensor, kv: KVAccess
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """ONE application of the shared block to rows ``[N, W]``.

        Returns ``(rows_out [N, W], signal [N] float32, lookahead [N] float32 | None)``; the signal is Ouro's
        gate hazard or Huginn's relative latent difference. ``steps`` (0-based) are informational: the depth
        slot of each token is already bound in ``kv``.
        """

    @abstractmethod
    def coda(self, rows: Tensor, positions: Tensor, kv: KVAccess | None) -> Tensor:
        """Bank rows ``[N, W]`` -> final hidden ``[N, hidden]`` ready for ``logits``."""

    def embed_input(self, token_ids: Tensor) -> Tensor:
        """The bank row of an input token, computed in the HEAD stage (``config.prelude_is_embedding`` only)."""
        raise NotImplementedError(f"{self.config.name}: the prelude cannot run in the head stage")

    @abstractmethod
    def logits(self, hidden: Tensor) -> Tensor:
        """LM head: ``[N, hidden]`` -> float32 logits ``[N, vocab]``."""


def init_states(seeds: Sequence[int], width: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Huginn initial recurrent states ``[N, width]``: zero for a negative seed, else the upstream draw.

    Upstream: truncated normal with std ``sqrt(2 / (5 width))`` clipped at +-3 std, times ``sqrt(width)``.
    Each row comes from its own CPU ``torch.Generator().manual_seed(seed)``, so it never depends on the batch.
    """
    out = torch.zeros(len(seeds), width, dtype=torch.float32)
    std = (2.0 / (5.0 * width)) ** 0.5
    for i, seed in enumerate(seeds):
        if seed >= 0:
            g = torch.Generator().manual_seed(seed)
            nn.init.trunc_normal_(out[i], mean=0.0, std=std, a=-3 * std, b=3 * std, generator=g)
    return (out * width**0.5).to(device=device, dtype=dtype)
