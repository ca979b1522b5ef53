"""A serving process's heap, settled once started (``services.heap``)."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator

import pytest

from cdb_bench import heap as bench_heap
from services import heap


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # the test process's heap goes back to being collected as before


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_settling_freezes_what_is_there_and_later_garbage_is_still_collected(unfrozen_after: None) -> None:
    before = _cycle()  # garbage made before settling is collected by it, not frozen
    kept = _Node()
    assert any(o is kept for o in gc.get_objects())
    frozen = heap.settle()
    assert before() is None
    assert frozen > 1000 and gc.get_freeze_count() > 1000  # the modules this process imported, at least
    assert not any(o is kept for o in gc.get_objects())  # frozen: in no generation, no collection scans it
    after = _cycle()
    assert after() is not None  # only the cyclic collector can free it
    gc.collect()
    assert after() is None


def test_the_measurement_reports_both_states(unfrozen_after: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_heap.main(["scheduler", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["process"] == "scheduler" and out["tracked_objects"] > 0
    assert out["frozen_objects"] > 0 and gc.get_freeze_count() > 0  # (settling collects first: garbage is not frozen)
    assert set(out["full_collection_ms"]) == {"unsettled", "settled"}
