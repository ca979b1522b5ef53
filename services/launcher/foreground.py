"""``serve_forever``: the tree in the foreground (``cdb serve``) until a signal, or until its supervisor gives up."""

from __future__ import annotations

import dataclasses
import signal
import sys
import tempfile
import threading

from cdb_engine.config import EngineConfig
from cdb_engine.limits import describe, resolve_limits
from cdb_model.loader import load_config
from services.launcher.log_relay import LogRelay
from services.launcher.supervisor import ServeHandle
from services.launcher.tree import serve_all
from services.settings.knobs import Settings
from services.settings.resolved import Resolved


def stop_signals() -> threading.Event:
    """Make SIGTERM, SIGINT (Ctrl-C) and SIGHUP (the terminal closed) set the event returned: a graceful stop.
    Main thread only."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_end(handle: ServeHandle, stop: threading.Event) -> int:
    """Serve until ``stop`` is set (exit status 0) or the supervisor stops the tree (1: it gave up, or could not
    restart a child; it has logged why in one line). The tree is stopped when this returns."""
    while not (stop.is_set() or handle.ended.is_set()):
        stop.wait(0.2)  # a watch period over both ends; a signal sets ``stop`` at once
    handle.stop()
    return 1 if handle.given_up else 0


def serve_forever(resolved: Resolved, listen: str = "127.0.0.1:50051") -> int:
    """Run the tree with ``resolved`` in the foreground until SIGTERM / Ctrl-C / SIGHUP (exit 0), or until the
    supervisor gives up on a child or cannot restart it (exit 1)."""
    config, settings = resolved.engine, resolved.settings
    with tempfile.TemporaryDirectory(prefix="cdb-logs-") as scratch:
        if not settings.log_dir:  # the children's files are relayed, then deleted with the folder
            settings = dataclasses.replace(settings, log_dir=scratch)
        relay = LogRelay(settings.log_dir, sys.stderr, json_lines=settings.log_format == "json").start()
        try:
            return _serve(config, settings, listen)
        finally:
            relay.stop()


def _serve(config: EngineConfig, settings: Settings, listen: str) -> int:
    try:
        handle = serve_all(config, listen, settings=settings)
    except RuntimeError as exc:  # a child failed to start: its last lines follow the first line
        print(f"cdb serve: {exc}", file=sys.stderr)
        return 1
    stop = stop_signals()
    limits = resolve_limits(config, load_config(config.model))
    n = len(handle.frontends)
    fronts = f"; {n} front-end process{'es' if n > 1 else ''}" if n else ""
    print(f"cdb serving {config.model} on {handle.address} (stages: prelude, loop, head{fronts})", flush=True)
    print(f"  {describe(limits)}", flush=True)
    if config.synthetic_cost:
        print(f"  SYNTHETIC stages: modelled device time {config.synthetic_cost}; tokens mean nothing", flush=True)
    if settings.http_addr:
        print(f"OpenAI-compatible HTTP API on http://{settings.http_addr}/v1", flush=True)
    if settings.metrics_addr:
        print(f"Prometheus metrics on http://{settings.metrics_addr}/metrics", flush=True)
    return wait_for_end(handle, stop)
