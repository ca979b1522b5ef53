"""Log lines of every process of the tree: their level and format, the request line and the throughput line.

- ``configure_logging(role, settings, level=None)``: each process (``cdb serve``'s launcher, ``cdb scheduler``,
  ``cdb stage``) calls it once at start. The level is ``--log-level`` where given, else ``CDB_LOG_LEVEL``; the
  format ``CDB_LOG_FORMAT``: ``text`` (``time role LEVEL message``) or ``json`` (one object per line, by
  python-json-logger: ``time``, ``level``, ``logger``, ``role``, ``message`` and the record's structured fields).
  The launcher's children inherit its environment, so one setting holds for the whole tree.
- The request line (logger ``cdb.requests``, opt-in: ``CDB_REQUEST_LOG``): one per finished request, with its
  id, the caller's scope, tokens in and out, mean served depth, finish reason and latency. Never the prompt or
  the text. Opting in enables that logger at INFO whatever the level, so ``--log-level warning`` keeps it.
- The throughput line (logger ``cdb.throughput``, ``ThroughputLog``): every ``CDB_THROUGHPUT_LOG_INTERVAL_S``
  while the scheduler works, the interval's generated and prompt tokens per second, mean served depth and mean
  loop-batch occupancy, with the running and waiting requests and the KV-cache usage; read from ``Metrics``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pythonjsonlogger.json import JsonFormatter

from services.telemetry.metrics import Metrics

if TYPE_CHECKING:  # services.settings imports the engine's config (torch)
    from services.settings import Settings

REQUEST_LOG = logging.getLogger("cdb.requests")
THROUGHPUT_LOG = logging.getLogger("cdb.throughput")
_HANDLER_FLAG = "_cdb_handler"  # marks the handler configure_logging installed (a second call replaces it)


class LineFormatter(logging.Formatter):
    """The text format: a record's message on one line, its control and separator characters (CR, LF, ESC, U+2028,
    ...) escaped as Python escapes, so that nothing a client chose (an id, a model name, a header) can start a
    line that reads as the server's own; a traceback still follows on its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        if not message.isprintable():
            record.message = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
        return super().formatMessage(record)


def configure_logging(role: str, settings: Settings, level: str | None = None, request_log: bool | None = None) -> None:
    """Set up this process's root logger: ``level`` (default ``settings.log_level``), ``settings.log_format``,
    ``role`` in every line (``scheduler``, ``prelude``, ...), and the request line if ``request_log`` (default
    ``settings.request_log``)."""
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _HANDLER_FLAG, True)
    if settings.log_format == "json":
        handler.setFormatter(
            JsonFormatter(
                "{asctime}{levelname}{name}{message}",
                style="{",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
                static_fields={"role": role},
            )
        )
    else:
        handler.setFormatter(LineFormatter(f"%(asctime)s {role} %(levelname)s %(message)s"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_FLAG, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel((level or settings.log_level).upper())
    logging.captureWarnings(True)  # Python warnings become records of this format too (logger py.warnings)
    on = settings.request_log if request_log is None else request_log
    REQUEST_LOG.setLevel(logging.INFO if on else logging.CRITICAL + 1)


def request_log_on() -> bool:
    """Whether finished requests are logged (checked once per request)."""
    return REQUEST_LOG.isEnabledFor(logging.INFO)


def log_request(
    request_id: str,
    caller: str,
    prompt_tokens: int,
    generated_tokens: int,
    mean_depth: float,
    finish_reason: str,
    latency_s: float,
) -> None:
    """The request line of one finished request (see the module docstring); its fields also as record extras."""
    fields = {
        "request_id": request_id,
        "caller": caller,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens,
        "mean_depth": round(mean_depth, 3),
        "finish_reason": finish_reason,
        "latency_s": round(latency_s, 6),
    }
    REQUEST_LOG.info(
        "request %s finished: caller=%s prompt_tokens=%d generated_tokens=%d mean_depth=%.2f finish_reason=%s "
        "latency=%.3fs",
        request_id,
        caller,
        prompt_tokens,
        generated_tokens,
        mean_depth,
        finish_reason,
        latency_s,
        extra=fields,
    )


@dataclass(frozen=True, slots=True)
class Throughput:
    """One interval's figures (``ThroughputLog.report``)."""

    interval_s: float
    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    mean_depth: float  # loop steps / generated tokens in the interval (0 without tokens)
    occupancy: float  # mean loop-batch occupancy of the interval's decode ops (0 without ops)
    running: int
    waiting: int
    kv_usage: float


class _Totals:
    """The cumulative counters the throughput line differentiates."""

    __slots__ = ("loop_steps", "occ_count", "occ_sum", "prompt", "tokens")

    def __init__(self, m: Metrics) -> None:
        self.tokens = m.generated_tokens.value()
        self.prompt = m.prompt_tokens.value()
        self.loop_steps = m.loop_steps.value()
        self.occ_sum = m.occupancy.sum()
        self.occ_count = m.occupancy.count()


class ThroughputLog:
    """The scheduler's throughput line every ``interval_s`` from a daemon thread (``start``; ``close`` stops it
    and logs the last partial interval). Quiet while the scheduler idles: an interval without tokens and with
    no request in flight writes nothing. ``report(now)`` computes (and logs) one interval: the thread and tests
    call it."""

    def __init__(self, metrics: Metrics, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self._clock = clock
        self._last = _Totals(metrics)
        self._last_t = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ThroughputLog:
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cdb-throughput-log", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):  # the period of the line, not a synchronisation
            self.report()

    def close(self) -> None:
        """Stop the thread; log the interval since the last line (when anything happened in it)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        self.report()

    def report(self, now: float | None = None) -> Throughput | None:
        """The figures of the interval since the last report, logged; None (and no line) for an idle one."""
        m = self.metrics
        with self._lock:
            now = self._clock() if now is None else now
            m.sample()  # fresh gauges: running, waiting, KV usage
            cur, last = _Totals(m), self._last
            dt = now - self._last_t
            self._last, self._last_t = cur, now
        tokens, prompt = cur.tokens - last.tokens, cur.prompt - last.prompt
        running, waiting = int(m.running.value()), int(m.waiting.value())
        if dt <= 0 or (tokens <= 0 and prompt <= 0 and running == 0 and waiting == 0):
            return None
        ops = cur.occ_count - last.occ_count
        t = Throughput(
            interval_s=dt,
            generation_tokens_per_s=tokens / dt,
            prompt_tokens_per_s=prompt / dt,
            mean_depth=(cur.loop_steps - last.loop_steps) / tokens if tokens > 0 else 0.0,
            occupancy=(cur.occ_sum - last.occ_sum) / ops if ops > 0 else 0.0,
            running=running,
            waiting=waiting,
            kv_usage=m.kv_usage.value(),
        )
        extra: dict[str, Any] = {k: round(v, 4) if isinstance(v, float) else v for k, v in _fields(t).items()}
        THROUGHPUT_LOG.info(
            "throughput: %.1f tokens/s generated, %.1f tokens/s prompt, mean depth %.2f, occupancy %.2f, "
            "running %d, waiting %d, KV cache %.1f %%",
            t.generation_tokens_per_s,
            t.prompt_tokens_per_s,
            t.mean_depth,
            t.occupancy,
            t.running,
            t.waiting,
            100 * t.kv_usage,
            extra=extra,
        )
        return t


def _fields(t: Throughput) -> dict[str, float | int]:
    return dataclasses.asdict(t)
