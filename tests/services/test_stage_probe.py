"""The stage's probe (``services.transport.stage_probe``): nothing measured costs nothing; a recording probe keeps
the op timeline and feeds the observer at the seams of an op."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from cdb_scheduler.plan import LoopOp, Stage, StageOp, StageResult
from services.transport.stage_probe import NO_PROBE, OP_LOG_FIELDS, RecordingProbe, stage_probe

pytestmark = pytest.mark.timeout(10)

OP = LoopOp(3, (), (), (5,), rids=(1, 2), positions=(0, 0), rows=(1, 2), steps=(0, 0))


class Observer:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def update(self, contexts: Mapping[int, str], released: Iterable[int] = ()) -> None:
        self.calls.append(("update", dict(contexts), tuple(released)))

    def record_op(self, op: StageOp, start_ns: int, end_ns: int, compute_s: float, error: str | None = None) -> None:
        self.calls.append(("record", op.seq, 0 < start_ns <= end_ns, compute_s, error))


def test_without_an_op_log_or_an_observer_the_session_gets_the_no_op_probe() -> None:
    assert stage_probe("", "loop", "sched", None) is NO_PROBE
    mark = NO_PROBE.begin(OP, {}, 0)
    NO_PROBE.fenced(mark)
    NO_PROBE.end(mark, OP, StageResult(Stage.LOOP, 3, 0.001))
    NO_PROBE.close()
    assert isinstance(stage_probe("", "loop", "sched", Observer()), RecordingProbe)


def test_a_recording_probe_keeps_the_timeline_of_ops_that_succeeded_and_feeds_the_observer(tmp_path: Path) -> None:
    observer = Observer()
    probe = stage_probe(str(tmp_path / "ops"), "loop", "sched", observer)
    mark = probe.begin(OP, {1: "ctx"}, 7)
    probe.fenced(mark)
    probe.end(mark, OP, StageResult(Stage.LOOP, 3, 0.001))
    failed = probe.begin(OP, {}, 8)  # its fences never met: no work started, no timeline record
    probe.end(failed, OP, StageResult(Stage.LOOP, 3, 0.0, error="fence timeout"))
    probe.close()
    assert observer.calls == [
        ("update", {1: "ctx"}, (5,)),
        ("record", 3, True, 0.001, None),
        ("update", {}, (5,)),
        ("record", 3, True, 0.0, "fence timeout"),
    ]
    (log,) = (tmp_path / "ops").glob("loop-*.json")
    written = json.loads(log.read_text())
    assert written["holder"] == "sched" and written["fields"] == list(OP_LOG_FIELDS)
    ((seq, tokens, arrived, dequeued, fenced, started, ended, compute_ns),) = written["ops"]
    assert (seq, tokens, arrived, compute_ns) == (3, 2, 7, 1_000_000)
    assert dequeued <= fenced and started == ended - compute_ns
