"""Every process's log lines on the launcher's stream, each naming its process (``services.launcher.log_relay``),
and a failed start showing only the last lines of the child that failed."""

from __future__ import annotations

import io
import json
from pathlib import Path

from services.launcher.log_relay import LogRelay
from services.launcher.tree import _failed_logs


def test_text_lines_are_prefixed_and_a_partial_line_waits_for_its_end(tmp_path: Path) -> None:
    out = io.StringIO()
    relay = LogRelay(str(tmp_path), out)
    (tmp_path / "scheduler.log").write_text("ready\nhalf a li")
    (tmp_path / "loop.log").write_text("loop up\n")
    relay._poll()
    assert out.getvalue().splitlines() == ["[loop] loop up", "[scheduler] ready"]
    with open(tmp_path / "scheduler.log", "a") as f:
        f.write("ne\nlast, unfinished")
    relay.stop()  # relays what is left, the unfinished line too
    assert out.getvalue().splitlines()[2:] == ["[scheduler] half a line", "[scheduler] last, unfinished"]


def test_json_lines_gain_the_process_and_other_lines_become_objects(tmp_path: Path) -> None:
    out = io.StringIO()
    relay = LogRelay(str(tmp_path), out, json_lines=True)
    record = {"level": "INFO", "message": "request cmpl-1 finished"}
    (tmp_path / "head.log").write_text(json.dumps(record) + "\nTraceback (most recent call last):\n")
    relay.stop()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == [
        {"process": "head", **record},
        {"process": "head", "message": "Traceback (most recent call last):"},
    ]


def test_a_kept_folder_is_relayed_from_where_it_ended(tmp_path: Path) -> None:
    (tmp_path / "scheduler.log").write_text("from an earlier run\n")
    out = io.StringIO()
    relay = LogRelay(str(tmp_path), out)
    with open(tmp_path / "scheduler.log", "a") as f:
        f.write("this run\n")
    relay.stop()
    assert out.getvalue() == "[scheduler] this run\n"


class _Handle:
    """What ``_failed_logs`` reads of a tree: which children exited and their output."""

    def __init__(self, logs: dict[str, str], exited: set[str]) -> None:
        self.logs, self.gone = logs, exited

    def exited(self, name: str) -> bool:
        return name in self.gone

    def log(self, name: str) -> str:
        return self.logs.get(name, "")

    def log_path(self, name: str) -> str:
        return f"/logs/{name}.log"


def test_a_failed_start_shows_the_last_lines_of_the_child_that_failed_only() -> None:
    crash = "\n".join(f"line {i}" for i in range(100)) + "\nValueError: bad checkpoint"
    handle = _Handle({"scheduler": "waiting for stages\n", "loop": crash, "head": "serving\n"}, exited={"loop"})
    text = _failed_logs(handle, ("scheduler", "prelude", "loop", "head"))  # type: ignore[arg-type]
    assert text.startswith("--- loop (last lines of /logs/loop.log) ---")
    assert text.endswith("ValueError: bad checkpoint") and "line 81" in text and "line 80" not in text
    assert "waiting for stages" not in text and "serving" not in text
    everyone = _failed_logs(_Handle({"head": "slow\n"}, exited=set()), ("scheduler", "head"))  # type: ignore[arg-type]
    assert "--- scheduler" in everyone and "slow" in everyone  # none exited (a timeout): every child's
