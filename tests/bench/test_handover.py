"""``cdb bench handover``: a futex hand-over between two processes, timed each way."""

from __future__ import annotations

import json

import pytest

from cdb_bench.handover import main

FIGURES = ("wake_cpu_us", "wake_wall_us", "wake_no_sleeper_us", "wakeup_latency_us", "spin_latency_us")


@pytest.mark.timeout(60)
def test_every_hand_over_is_timed_from_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trials", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trials"] == 40 and out["cores"] >= 1
    for name in FIGURES:
        f = out[name]
        # (for the two latencies: the receiver ran after the sender published, its stamp later than the sender's)
        assert 0.0 < f["p50"] <= f["p90"] and f["mean"] > 0.0, name


def test_a_trial_count_below_one_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--trials", "0"])
    assert exc.value.code == 2
