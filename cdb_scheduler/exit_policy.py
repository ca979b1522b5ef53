"""Exit policies: when does a token leave the loop?

Shared by the scheduler and the sequential reference path, so both apply literally the same rule.

Steps are 0-based; a token that exits after step ``s`` was served at depth ``s + 1``. ``signal`` is what the loop
stage reports after a step (Ouro: gate hazard lambda; Huginn: relative latent difference).

Decision horizon:
- ``SAME_STEP``: the signal of step s decides whether the token exits after step s.
- ``ONE_AHEAD``: the signal of step s-1 decides whether the token exits after step s, so the scheduler knows a
  token's fate before the step that runs it has finished. With a same-step gate the token exits one step late.
  With Ouro's lookahead gate (the hazard of step s predicted from the state after step s-1) the decision for
  s >= 1 equals the same-step one wherever the prediction crosses the threshold where the real hazard does; how
  often that holds is a property of the trained gate (measured, not assumed). Nothing is observed before step 0
  runs, so a one-ahead decision never exits after step 0: a token whose same-step exit is at depth 1 is served at
  depth 2 (or ``min_depth``, whichever is larger).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass


class Horizon(enum.StrEnum):
    SAME_STEP = "same-step"
    ONE_AHEAD = "one-ahead"


class ExitRule(enum.StrEnum):
    """Which signal ends a token's loop (``AUTO``: the model family's own: Ouro gate hazard, Huginn latent diff)."""

    AUTO = "auto"
    HAZARD = "hazard"  # Ouro: exit once the gate's exit CDF reaches the threshold q
    LATENT_DIFF = "latent-diff"  # Huginn: exit once the relative change of the latent state falls below q
    FIXED = "fixed"  # every token at one depth
    REPLAY = "replay"  # depths given per token by the request (benchmarks)


@dataclass(slots=True)
class ExitState:
    """Per-token exit bookkeeping (one per token in the loop)."""

    observed: int  # number of step signals observed so far
    cdf: float  # Ouro: cumulative exit probability through the last observed step
    survival: float  # Ouro: prod(1 - lambda) through the last observed step
    last_signal: float
    next_hazard: float | None  # Ouro lookahead: predicted hazard of the next step
    target_depth: int  # fixed / replayed depth (0: not used)

    def __init__(self, target_depth: int = 0) -> None:  # (native: one per token in the loop; the starting values)
        self.observed, self.cdf, self.survival, self.last_signal = 0, 0.0, 1.0, 1.0
        self.next_hazard = None
        self.target_depth = target_depth


class ExitPolicy(ABC):
    """A per-token stopping rule with a maximum and minimum served depth.

    Protocol, per token: ``state = new_state()``; after each step s completes, ``observe(state, s, signal,
    lookahead)``; whether the token exits after step s is ``exits_after(state, s)``, called once ``s`` (same-step)
    or ``s - 1`` (one-ahead) signals have been observed.
    """

    def __init__(self, max_depth: int, min_depth: int = 1, horizon: Horizon = Horizon.ONE_AHEAD) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if not 1 <= min_depth <= max_depth:
            raise ValueError(f"min_depth must be in [1, max_depth={max_depth}], got {min_depth}")
        self.max_depth = max_depth
        self.min_depth = min_depth
        self.horizon = horizon
        self._observed_to_decide = 0 if horizon is Horizon.ONE_AHEAD else 1  # signals past ``step`` a decision needs

    needs_signals: bool = True
    """False when depths are known in advance (fixed, replay): the loop stage need not report signals."""

    def new_state(self, target_depth: int = 0) -> ExitState:
        return ExitState(target_depth=target_depth)

    def observe(self, st: ExitState, step: int, signal: float, lookahead: float | None = None) -> None:
        assert step == st.observed, f"signals must arrive in step order: got step {step}, expected {st.observed}"
        st.observed += 1
        st.last_signal = signal
        st.cdf += signal * st.survival
        st.survival *= 1.0 - signal
        st.next_hazard = lookahead

    def decision(self, st: ExitState, step: int) -> bool | None:
        """Whether the token exits after ``step``, if what was observed so far decides it now; None: not yet
        (the horizon's signal is still to come)."""
        if not self.needs_signals or step + 1 >= self.max_depth or step + 1 < self.min_depth:
            return self.exits_after(st, step)
        return self.exits_after(st, step) if st.observed == step + self._observed_to_decide else None

    def exits_after(self, st: ExitState, step: int) -> bool:
        if step + 1 >= self.max_depth:
            return True
        if step + 1 < self.min_depth:
            return False
        if self.horizon is Horizon.SAME_STEP:
            assert st.observed == step + 1, f"same-step decision for step {step} needs its signal"
            return self._stop(st, lookahead=False)
        assert st.observed >= step, f"one-ahead decision for step {step} needs the signal of step {step - 1}"
        if step == 0:
            return False  # nothing observed yet: no signal can have decided
        if st.observed > step:  # the signal of this step is already in (a slow decision path): ignore it
            raise AssertionError("one-ahead decisions must be taken before the step's own signal is used")
        return self._stop(st, lookahead=True)

    @abstractmethod
    def _stop(self, st: ExitState, lookahead: bool) -> bool:
        """The raw rule on the signals observed so far."""


class OuroHazard(ExitPolicy):
    """Ouro: exit at the first step whose exit CDF reaches ``q`` (q in (0, 1]; 1.0 = full depth).

    The PDF is the upstream one: p_t = lambda_t * prod_{j<t}(1 - lambda_j), the last step taking all remaining
    mass (handled by ``max_depth``). With a lookahead gate (one-ahead), the hazard of the step being decided is
    the lookahead prediction made one step earlier (see the module docstring for when that equals same-step).
    """

    def __init__(self, q: float, max_depth: int, min_depth: int = 1, horizon: Horizon = Horizon.ONE_AHEAD):
        if not 0.0 < q <= 1.0:
            raise ValueError(f"Ouro exit threshold q must be in (0, 1], got {q}")
        super().__init__(max_depth, min_depth, horizon)
        self.q = q

    def _stop(self, st: ExitState, lookahead: bool) -> bool:
        if lookahead and st.next_hazard is not None:
            return st.cdf + st.next_hazard * st.survival >= self.q
        return st.cdf >= self.q

    def decision(self, st: ExitState, step: int) -> bool | None:
        # ``ExitPolicy.decision`` -> ``exits_after`` -> ``_stop`` in one frame: it runs for every token in every
        # loop op, usually twice (at issue, then when the signal it waits for is in).
        n = step + 1
        if n >= self.max_depth:
            return True
        if n < self.min_depth:
            return False
        if self.horizon is Horizon.ONE_AHEAD:
            if st.observed != step:
                return None
            if step == 0:
                return False
            hazard = st.next_hazard
            return (st.cdf + hazard * st.survival if hazard is not None else st.cdf) >= self.q
        return st.cdf >= self.q if st.observed == n else None


class LatentDiff(ExitPolicy):
    """Huginn: exit when ||s_t - s_{t-1}|| / ||s_t|| < q (q = 0: never exit early)."""

    def __init__(self, q: float, max_depth: int, min_depth: int = 1, horizon: Horizon = Horizon.ONE_AHEAD):
        if q < 0.0:
            raise ValueError(f"latent-diff exit threshold q must be >= 0, got {q}")
        super().__init__(max_depth, min_depth, horizon)
        self.q = q

    def observe(self, st: ExitState, step: int, signal: float, lookahead: float | None = None) -> None:
        assert step == st.observed
        st.observed += 1
        st.last_signal = signal

    def _stop(self, st: ExitState, lookahead: bool) -> bool:
        return st.last_signal < self.q


class FixedDepth(ExitPolicy):
    """Every token runs exactly ``depth`` steps (``depth == max_depth``: full depth)."""

    def __init__(self, depth: int, max_depth: int):
        if not 1 <= depth <= max_depth:
            raise ValueError(f"fixed depth must be in [1, {max_depth}], got {depth}")
        super().__init__(max_depth, 1, Horizon.SAME_STEP)
        self.depth = depth

    needs_signals = False

    def observe(self, st: ExitState, step: int, signal: float, lookahead: float | None = None) -> None:
        st.observed += 1

    def exits_after(self, st: ExitState, step: int) -> bool:
        return step + 1 >= min(self.depth, self.max_depth)

    def _stop(self, st: ExitState, lookahead: bool) -> bool:  # pragma: no cover - exits_after decides
        return False


class ReplayDepth(ExitPolicy):
    """Benchmarks: each token exits at a depth given in advance (``new_state(target_depth=d)``)."""

    def __init__(self, max_depth: int):
        super().__init__(max_depth, 1, Horizon.SAME_STEP)

    needs_signals = False

    def observe(self, st: ExitState, step: int, signal: float, lookahead: float | None = None) -> None:
        st.observed += 1

    def exits_after(self, st: ExitState, step: int) -> bool:
        assert st.target_depth >= 1, "replayed token without a target depth"
        return step + 1 >= min(st.target_depth, self.max_depth)

    def _stop(self, st: ExitState, lookahead: bool) -> bool:  # pragma: no cover - exits_after decides
        return False
