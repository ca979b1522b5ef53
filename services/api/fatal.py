"""The scheduler process ends when its engine loop cannot go on, so that it is restarted.

A scheduler whose engine loop has died could only refuse every request while staying alive (and its health
probe's restart takes long). ``ExitOnEngineFailure`` is the engine's ``on_fatal``: it runs on the engine thread once
every live request has been failed, logs one line and stops the process as SIGTERM does (the drain is quick: nothing
is live); ``run_scheduler`` then exits 1. Should the process still run ``grace_s`` later (a failure during start-up,
before the server listens for the signal), it exits 1 at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("cdb.scheduler")


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class ExitOnEngineFailure:
    """``Engine(on_fatal=...)`` of the scheduler process (module docstring). ``error``: the engine's failure, once
    it has happened; ``stop`` and ``hard_exit`` are the process-wide actions (replaceable in tests)."""

    def __init__(
        self,
        grace_s: float,
        *,
        stop: Callable[[], None] = _terminate_self,
        hard_exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.grace_s = grace_s
        self.error: str | None = None
        self._stop = stop
        self._hard_exit = hard_exit
        self.timer: threading.Timer | None = None

    def __call__(self, error: str) -> None:
        if self.error is not None:
            return
        self.error = error
        log.critical("%s; the scheduler exits 1 so that it is restarted", error)
        self.timer = threading.Timer(self.grace_s, self._hard_exit, (1,))
        self.timer.daemon = True
        self.timer.start()
        self._stop()
