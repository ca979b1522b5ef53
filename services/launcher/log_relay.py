"""Every process's log lines on the launcher's own stream, each naming its process: where operators look
(``docker logs``, ``kubectl logs``, a terminal, journald).

A tree's children write their output to one file each (``NAME.log`` in the log folder: ``CDB_LOG_DIR``, else the
tree's temporary folder); ``LogRelay`` follows those files and writes each complete line to ``out`` as it appears:
in text, behind the process's name (``[scheduler] ...``); in JSON (``CDB_LOG_FORMAT=json``), as the line's own
object with a ``"process"`` field (a line that is not a JSON object, such as a traceback's, becomes
``{"process": ..., "message": line}``), so that every line on the stream is one JSON object. ``stop()`` relays what
is left, then returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from typing import TextIO

POLL_S = 0.1  # how often the files are looked at
_READ = 1 << 20  # bytes read from one file at a time


class LogRelay:
    """Follows ``folder``'s ``*.log`` files onto ``out`` (module docstring)."""

    def __init__(self, folder: str, out: TextIO, *, json_lines: bool = False) -> None:
        self.folder, self.out, self.json_lines = folder, out, json_lines
        self._offsets: dict[str, int] = {}  # (a kept folder's files: relayed from their end at start)
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                if name.endswith(".log"):
                    self._offsets[name] = os.path.getsize(os.path.join(folder, name))
        self._partial: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cdb-log-relay", daemon=True)

    def start(self) -> LogRelay:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Relay what the files hold now (a last unfinished line too), then end."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._poll(final=True)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    def _poll(self, final: bool = False) -> None:
        try:
            names = sorted(n for n in os.listdir(self.folder) if n.endswith(".log"))
        except OSError:
            return
        for name in names:
            self._follow(name, final)
        self.out.flush()

    def _follow(self, name: str, final: bool) -> None:
        path = os.path.join(self.folder, name)
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(name, 0))
                data = f.read(_READ)
        except OSError:
            return
        if not data and not (final and self._partial.get(name)):
            return
        self._offsets[name] = self._offsets.get(name, 0) + len(data)
        lines = (self._partial.pop(name, b"") + data).split(b"\n")
        tail = lines.pop()
        if tail and final:
            lines.append(tail)
        elif tail:
            self._partial[name] = tail
        process = name.removesuffix(".log")
        write: Callable[[str], object] = self.out.write
        for raw in lines:
            text = raw.decode("utf-8", errors="replace").rstrip("\r")
            if text:
                write(self._shaped(process, text) + "\n")

    def _shaped(self, process: str, text: str) -> str:
        if not self.json_lines:
            return f"[{process}] {text}"
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            record = {"message": text}
        return json.dumps({"process": process, **record}, ensure_ascii=False)
