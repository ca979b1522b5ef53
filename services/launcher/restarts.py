"""When the supervisor restarts a child that exited, and when it gives up on it (the package docstring,
"Supervision"); and the record of one restart."""

from __future__ import annotations

import dataclasses

from services.settings.knobs import Settings


@dataclasses.dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When a child that exited is restarted, and when it is given up on (the package docstring, "Supervision")."""

    backoff_s: float  # the delay before the 2nd restart of a streak (the 1st is at once), doubling
    backoff_max_s: float  # the longest delay
    limit: int  # the exit of a streak that gives up

    @classmethod
    def from_settings(cls, settings: Settings) -> RestartPolicy:
        return cls(settings.restart_backoff_s, settings.restart_backoff_max_s, settings.restart_limit)

    def delay(self, streak: int) -> float | None:
        """Seconds before restarting a child whose streak (its exits in a row, the last one included) is
        ``streak``; None: give up on it."""
        if streak >= self.limit:
            return None
        if streak <= 1:
            return 0.0
        return float(min(self.backoff_s * 2 ** (streak - 2), self.backoff_max_s))


@dataclasses.dataclass(frozen=True, slots=True)
class Restart:
    """One restart: ``code`` is the exit status of the process replaced (negative: the signal that ended it);
    times are ``time.monotonic()``; ``streak`` counts that process's exit."""

    name: str
    code: int
    exited_at: float
    started_at: float
    streak: int
