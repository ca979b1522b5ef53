"""The loop op's cost fitted online against its width, and the rule of ``--speculative auto`` on it: drafts are
taken only where they raise a loop op's tokens per second (``cdb_scheduler.loop_cost``)."""

from __future__ import annotations

import random

import pytest

from cdb_scheduler.loop_cost import (
    EXPLORE_EVERY,
    MARGIN,
    MIN_VERDICTS,
    PRIOR_ACCEPTANCE,
    TRIAL_EXPLORE,
    TRIAL_OPS,
    DraftTrial,
    LoopCost,
    drafts_that_pay,
    expected_ops,
    judged_acceptance,
)


def fitted(alpha: float, beta: float, widths: list[int], noise: float = 0.0, seed: int = 0) -> LoopCost:
    rng = random.Random(seed)
    cost = LoopCost()
    for w in widths:
        cost.observe(w, (alpha + beta * w) * (1.0 + rng.uniform(-noise, noise)))
    return cost


def test_the_fit_recovers_intercept_and_slope_from_noisy_ops() -> None:
    rng = random.Random(1)
    cost = fitted(1e-3, 2e-5, [rng.randint(1, 64) for _ in range(400)], noise=0.05)
    assert cost.trusted
    assert cost.alpha == pytest.approx(1e-3, rel=0.1) and cost.beta == pytest.approx(2e-5, rel=0.15)


def test_the_fit_follows_a_new_regime_and_forgets_the_old() -> None:
    rng = random.Random(2)
    cost = fitted(1e-3, 0.0, [rng.randint(1, 64) for _ in range(300)])
    assert cost.beta == pytest.approx(0.0, abs=1e-7)
    for _ in range(400):
        w = rng.randint(1, 64)
        cost.observe(w, 3e-5 * w)
    assert cost.alpha == pytest.approx(0.0, abs=2e-5) and cost.beta == pytest.approx(3e-5, rel=0.05)


def test_one_width_reads_as_all_per_token_and_explores_until_a_fit_is_trusted() -> None:
    cost = fitted(1e-3, 0.0, [1] * 50)
    assert not cost.trusted and cost.alpha == 0.0 and cost.beta == pytest.approx(1e-3)
    explored = [cost.explore() for _ in range(4 * EXPLORE_EVERY)]
    assert sum(explored) == 4 and explored[EXPLORE_EVERY - 1]
    for _ in range(3):  # an exploring op's draft: the op at width 2
        cost.observe(2, 1e-3)
    assert cost.trusted and cost.beta == pytest.approx(0.0, abs=1e-9) and cost.alpha == pytest.approx(1e-3)
    assert not any(cost.explore() for _ in range(4 * EXPLORE_EVERY)), "no exploring once a fit is trusted"
    assert sum(cost.explore(need_verdicts=True) for _ in range(4 * EXPLORE_EVERY)) == 4, "until drafts are judged"


def test_a_requests_acceptance_counts_once_verified_and_the_servers_before() -> None:
    assert judged_acceptance(0.9, MIN_VERDICTS, 0, 0) == 0.9
    assert judged_acceptance(1.0, 0, 0, 0) == PRIOR_ACCEPTANCE, "nothing verified anywhere: the cautious prior"
    assert judged_acceptance(1.0, 1, 17, 20) == pytest.approx(0.85), "the server's drafts speak for a new request"
    assert judged_acceptance(0.3, 1, 17, 20) == 0.3


def gains(n: int, depth: float = 3.0, draft_depth: int = 1, acceptance: float = 0.8) -> list[float]:
    e = expected_ops(depth, draft_depth, acceptance)
    return [1.0 / e - 1.0 / depth] * n


def test_drafts_never_pay_where_an_op_costs_per_token() -> None:
    """A CPU's loop op: a draft doubles a lone request's op to save well under half of its ops."""
    cost = fitted(0.0, 1e-4, list(range(1, 65)))
    for width in (1, 4, 32):
        assert drafts_that_pay(cost, width, width / 3.0, gains(width)) == 0


def test_every_draft_that_saves_ops_pays_where_an_op_costs_the_same_at_any_width() -> None:
    cost = fitted(1e-3, 0.0, list(range(1, 65)))
    assert drafts_that_pay(cost, 1, 1 / 3.0, gains(1)) == 1
    assert drafts_that_pay(cost, 8, 8 / 3.0, gains(8)) == 8
    assert drafts_that_pay(cost, 8, 8 / 3.0, gains(8, acceptance=0.1)) == 0, "a draft that costs ops never pays"


def test_with_a_fixed_and_a_per_token_part_drafts_pay_only_while_the_op_is_small() -> None:
    cost = fitted(1e-3, 5e-5, list(range(1, 65)))  # the fixed part is worth 20 tokens
    few = drafts_that_pay(cost, 2, 2 / 3.0, gains(2))
    many = drafts_that_pay(cost, 48, 48 / 3.0, gains(16))
    assert few == 2 and many == 0
    # and exactly where the op's tokens per second stop growing by more than the margin
    k = drafts_that_pay(cost, 14, 14 / 3.0, gains(14))
    rate = [(14 / 3.0 + j * gains(1)[0]) / cost.cost(14 + j) for j in range(15)]
    assert 0 < k < 14 and rate[k] > rate[0] and rate[k + 1] <= rate[k] * (1 + MARGIN)


def run_trial(gain: float, epochs: int, drift: float = 0.0, noise: float = 0.0, wanted: bool = True) -> list[bool]:
    """Feed a ``DraftTrial`` ``epochs`` epochs of ops whose tokens per second is ``gain`` times higher with drafts
    (times ``1 + drift`` more each epoch, with relative ``noise``); the arm of each epoch."""
    rng = random.Random(3)
    trial = DraftTrial()
    tokens = drafts = 0
    arms: list[bool] = []
    for e in range(epochs):
        arms.append(trial.drafting)
        rate = 1000.0 * (1.0 + drift) ** e * (gain if trial.drafting else 1.0) * (1.0 + rng.uniform(-noise, noise))
        for _ in range(TRIAL_OPS):
            if trial.drafting and wanted:
                drafts += 1
            tokens += 1
            trial.observe(1.0 / rate, tokens, drafts)
    assert trial.epochs == epochs
    return arms


@pytest.mark.parametrize("gain", [0.8, 0.95])
def test_the_trial_stops_drafting_that_lowers_the_measured_rate(gain: float) -> None:
    arms = run_trial(gain, 400, noise=0.02)
    later = arms[40:]
    assert sum(later) <= len(later) / TRIAL_EXPLORE + 1, "drafting only in the epochs that explore it"


def test_the_trial_keeps_drafting_that_raises_the_measured_rate() -> None:
    arms = run_trial(1.5, 400, noise=0.05)
    later = arms[40:]
    assert len(later) - sum(later) <= len(later) / TRIAL_EXPLORE + 1, "not drafting only while exploring"


def test_a_load_that_grows_does_not_pass_for_a_gain() -> None:
    """Adjacent epochs are compared: a rate that rises 3 % an epoch whatever the arm is no reason to draft."""
    arms = run_trial(1.0, 200, drift=0.03)
    assert sum(arms[40:]) <= len(arms[40:]) / TRIAL_EXPLORE + 1


def test_epochs_in_which_the_rule_drafted_nothing_compare_nothing() -> None:
    """Where the cost rule wants no draft the arms do the same: they alternate and no verdict forms."""
    trial = DraftTrial()
    for k in range(10 * TRIAL_OPS):
        trial.observe(1e-3 if trial.drafting else 2e-3, k, 0)
    assert trial.pairs == 0 and trial.verdict
