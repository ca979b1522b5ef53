"""The values a request carries to its sampling: settings, logits processing and the logprobs it gets back.

Plain dataclasses, not compiled with the scheduler (``cdb_scheduler._native``): they cross the front-end link as
typed messages, whose codec (msgspec) reads their annotations, and a compiled class keeps none it could read
(``X | None`` becomes ``type``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; validated by the engine before a request is admitted.

    ``temperature == 0`` is greedy. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable those filters
    (``min_p``: after temperature, the tokens less likely than ``min_p`` times the most likely one are dropped).
    The random stream of a sampled token depends only on ``(seed, token_index)``, never on the batch it runs in.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    logprobs: int = 0  # number of top alternatives to return (0: only the sampled token's logprob if asked)
    return_logprob: bool = False
    processing: LogitsProcessing | None = None  # penalties, logit bias, min_tokens (None: the logits as they are)


@dataclass(frozen=True, slots=True)
class LogitsProcessing:
    """What is done to a request's logits before temperature and filters, in this order (vLLM's): ``logit_bias``
    added; while the token index is below ``min_tokens`` the ``stop_ids`` (end-of-sequence and stop ids) banned; the
    repetition penalty on every token of the prompt or the output so far (a positive logit divided by it, a negative
    one multiplied); the frequency penalty times each token's count in the output so far, and the presence penalty
    once for each token in it, subtracted; then (structured output) every token its mask leaves out banned
    (``cdb_scheduler.plan.MASKS``). Logprobs are those of the logits before processing, with a mask applied."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # banned while the token index < min_tokens

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the request's history (prompt and output so far)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class Guide(Protocol):
    """A structured-output request's grammar walk (``cdb_engine.guide.Guide``), as the scheduler drives it: each
    token it samples goes with its mask; a forced token is known before it is sampled (its position exits at the
    minimum depth); every sampled token is accepted in order."""

    error: str  # why the walk failed ("" while it has not)

    def mask_now(self, index: int, wait: bool) -> bytes: ...

    def fate(self, index: int) -> int: ...

    def mask(self, index: int) -> bytes: ...

    def forced(self, index: int) -> int: ...

    def accept(self, index: int, token: int) -> bool: ...


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top alternatives (ids and logprobs, best first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
