"""Exit policies: the upstream Ouro CDF rule, Huginn latent difference, horizons, lookahead, depth limits."""

from __future__ import annotations

import random

import pytest

from cdb_scheduler.exit_policy import ExitPolicy, FixedDepth, Horizon, LatentDiff, OuroHazard, ReplayDepth


def served_depth(policy: ExitPolicy, signals: list[float], lookahead: list[float] | None = None) -> int:
    st = policy.new_state()
    for s in range(policy.max_depth):
        if policy.horizon is Horizon.ONE_AHEAD:
            leave = policy.exits_after(st, s)
            policy.observe(st, s, signals[s], lookahead[s] if lookahead else None)
        else:
            policy.observe(st, s, signals[s])
            leave = policy.exits_after(st, s)
        if leave:
            return s + 1
    raise AssertionError("max depth must end the loop")


def test_ouro_cdf_matches_the_upstream_pdf_cumsum() -> None:
    hazards = [0.1, 0.3, 0.6, 0.9]
    pdf, survive = [], 1.0
    for lam in hazards[:-1]:
        pdf.append(lam * survive)
        survive *= 1 - lam
    cdf = [sum(pdf[: i + 1]) for i in range(3)]  # 0.1, 0.37, 0.748
    for q, want in [(0.05, 1), (0.2, 2), (0.37, 2), (0.5, 3), (0.9, 4), (1.0, 4)]:
        assert served_depth(OuroHazard(q, 4, 1, Horizon.SAME_STEP), hazards) == want, (q, cdf)


def test_one_ahead_exits_one_step_later_than_same_step() -> None:
    rng = random.Random(0)
    for _ in range(200):
        hz = [rng.random() for _ in range(4)]
        q = rng.choice([0.2, 0.5, 0.8])
        same = served_depth(OuroHazard(q, 4, 1, Horizon.SAME_STEP), hz)
        ahead = served_depth(OuroHazard(q, 4, 1, Horizon.ONE_AHEAD), hz)
        assert ahead == min(same + 1, 4)


def test_lookahead_gate_makes_one_ahead_decisions_exact() -> None:
    rng = random.Random(1)
    for _ in range(200):
        hz = [rng.random() for _ in range(4)]
        predicted = [*hz[1:], 0.0]  # the lookahead after step s predicts the hazard of step s+1 exactly
        q = rng.choice([0.2, 0.5, 0.8])
        same = served_depth(OuroHazard(q, 4, 1, Horizon.SAME_STEP), hz)
        ahead = served_depth(OuroHazard(q, 4, 1, Horizon.ONE_AHEAD), hz, predicted)
        assert ahead == max(same, 2)  # exact, except that step 0 can never be decided one step ahead


def test_latent_diff_threshold_min_depth_and_never() -> None:
    diffs = [1.0, 0.5, 0.2, 0.05, 0.01, 0.01, 0.01, 0.01]
    assert served_depth(LatentDiff(0.1, 8, 1, Horizon.SAME_STEP), diffs) == 4
    assert served_depth(LatentDiff(0.1, 8, 6, Horizon.SAME_STEP), diffs) == 6
    assert served_depth(LatentDiff(0.0, 8, 1, Horizon.SAME_STEP), diffs) == 8
    assert served_depth(LatentDiff(0.1, 8, 1, Horizon.ONE_AHEAD), diffs) == 5


def test_fixed_and_replayed_depths_need_no_signals() -> None:
    fixed = FixedDepth(3, 4)
    assert not fixed.needs_signals and served_depth(fixed, [0.0] * 4) == 3
    replay = ReplayDepth(4)
    st = replay.new_state(target_depth=2)
    assert [replay.exits_after(st, s) for s in range(2)] == [False, True]


@pytest.mark.parametrize(
    "make",
    [
        lambda: OuroHazard(0.0, 4),
        lambda: OuroHazard(1.5, 4),
        lambda: LatentDiff(-0.1, 4),
        lambda: FixedDepth(5, 4),
        lambda: OuroHazard(0.5, 4, min_depth=5),
    ],
)
def test_invalid_policies_are_refused(make) -> None:
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("horizon", list(Horizon))
def test_ouro_fast_decision_equals_the_generic_rule(horizon: Horizon) -> None:
    """``OuroHazard.decision`` (one frame, on every token of every loop op) gives what the generic
    ``ExitPolicy.decision`` -> ``exits_after`` -> ``_stop`` chain gives, at every step, before and after the
    signal each decision waits for, with and without a lookahead gate."""
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        max_depth = rng.randint(1, 6)
        policy = OuroHazard(rng.choice([0.2, 0.5, 0.9, 1.0]), max_depth, rng.randint(1, max_depth), horizon)
        lookahead = rng.random() < 0.5
        st = policy.new_state()
        for step in range(max_depth):
            for _ in range(2):  # before and after this step's signal is observed
                if horizon is Horizon.ONE_AHEAD and st.observed > step:
                    break  # a one-ahead decision is never asked once its own step's signal is in
                assert policy.decision(st, step) == ExitPolicy.decision(policy, st, step)
                checked += 1
                if st.observed == step:
                    policy.observe(st, step, rng.random(), rng.random() if lookahead else None)
    assert checked > 1000
