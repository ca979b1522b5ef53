"""The serving benchmark's inputs: seeded arrival processes, data-set length fits, the mode-independent request set."""

from __future__ import annotations

import random
import statistics

import pytest

from cdb_bench.serve.arrivals import Arrival, arrival_times, unit_gaps
from cdb_bench.serve.lengths import DATASETS, clipped_mean, draw_lengths
from cdb_bench.serve.requests import RequestSet, make_requests, warmup_requests


@pytest.mark.parametrize("process", list(Arrival))
def test_arrivals_are_reproducible_from_the_seed(process: Arrival) -> None:
    assert unit_gaps(process, 50, cv=2.0, seed=3) == unit_gaps(process, 50, cv=2.0, seed=3)
    assert unit_gaps(process, 50, cv=2.0, seed=3) != unit_gaps(process, 50, cv=2.0, seed=4)


def test_poisson_arrivals_have_the_requested_mean_rate_and_cv_one() -> None:
    gaps = unit_gaps(Arrival.POISSON, 20000, seed=1)
    times = arrival_times(gaps, rate=5.0)
    measured_rate = (len(times) - 1) / times[-1]
    assert measured_rate == pytest.approx(5.0, rel=0.03)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)


def test_gamma_arrivals_are_burstier_than_poisson_at_the_same_rate() -> None:
    gaps = unit_gaps(Arrival.GAMMA, 40000, cv=2.0, seed=2)
    cv = statistics.stdev(gaps) / statistics.fmean(gaps)
    assert cv > 1.5 and cv == pytest.approx(2.0, rel=0.1)
    times = arrival_times(gaps, rate=4.0)
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.05)


def test_arrival_times_start_at_zero_and_scale_with_the_rate() -> None:
    gaps = [1.0, 2.0, 3.0]
    assert arrival_times(gaps, 2.0) == [0.0, 0.5, 1.5]
    with pytest.raises(ValueError):
        arrival_times(gaps, 0.0)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_length_fits_match_the_published_means_at_scale_one(name: str) -> None:
    fit = DATASETS[name]
    assert clipped_mean(fit.prompt) == pytest.approx(fit.prompt.target_mean, rel=1e-3)
    assert clipped_mean(fit.output) == pytest.approx(fit.output.target_mean, rel=1e-3)
    lengths = draw_lengths(fit, 20000, scale=1.0, max_input=4095, max_total=4096, rng=random.Random(0))
    assert statistics.fmean(p for p, _ in lengths) == pytest.approx(fit.prompt.target_mean, rel=0.05)
    assert statistics.fmean(o for _, o in lengths) == pytest.approx(fit.output.target_mean, rel=0.05)
    assert all(fit.prompt.lo <= p <= fit.prompt.hi and fit.output.lo <= o <= fit.output.hi for p, o in lengths)


def test_sharegpt_is_long_tailed_and_longer_than_alpaca() -> None:
    rng = random.Random(0)
    share = [o for _, o in draw_lengths(DATASETS["sharegpt"], 5000, scale=1.0, max_input=4095, max_total=4096, rng=rng)]
    alpaca = [o for _, o in draw_lengths(DATASETS["alpaca"], 5000, scale=1.0, max_input=4095, max_total=4096, rng=rng)]
    assert statistics.fmean(share) > statistics.median(share)  # right-skewed
    assert statistics.fmean(share) > 4 * statistics.fmean(alpaca)


def test_scale_shrinks_lengths_and_the_model_limits_clip_them() -> None:
    fit = DATASETS["sharegpt"]
    full = draw_lengths(fit, 2000, scale=1.0, max_input=4095, max_total=4096, rng=random.Random(5))
    small = draw_lengths(fit, 2000, scale=0.1, max_input=4095, max_total=4096, rng=random.Random(5))
    assert statistics.fmean(o for _, o in small) == pytest.approx(0.1 * statistics.fmean(o for _, o in full), rel=0.05)
    tight = draw_lengths(fit, 2000, scale=1.0, max_input=100, max_total=300, rng=random.Random(5))
    assert all(p <= 100 and p + o <= 300 and o >= 2 for p, o in tight)


def _requests(seed: int = 0, depth: tuple[float, int, int] | None = (2.5, 1, 4)) -> RequestSet:
    opts = {"vocab": 512, "scale": 0.5, "max_input": 4095, "max_total": 4096, "cv": 2.0}
    return make_requests(DATASETS["alpaca"], 40, depth=depth, arrival=Arrival.GAMMA, seed=seed, **opts)


def test_the_request_set_is_seeded_and_rates_change_only_the_arrival_times() -> None:
    reqs = _requests()
    assert reqs == _requests()
    slow, fast = reqs.at(1.0), reqs.at(4.0)
    assert [(r.prompt, r.max_tokens, r.replay_depths) for r in slow] == [
        (r.prompt, r.max_tokens, r.replay_depths) for r in fast
    ]
    assert [4 * f.arrival_s for f in fast] == pytest.approx([s.arrival_s for s in slow])
    for r in reqs.requests:
        assert r.replay_depths is not None and len(r.replay_depths) == r.max_tokens - 1
        assert all(1 <= d <= 4 for d in r.replay_depths) and all(3 <= t < 512 for t in r.prompt)
    depths = [d for r in reqs.requests for d in r.replay_depths or ()]
    assert statistics.fmean(depths) == pytest.approx(2.5, abs=0.2)


def test_live_depths_and_warmup_requests() -> None:
    assert all(r.replay_depths is None for r in _requests(depth=None).requests)
    warm = warmup_requests(_requests(), 3, max_tokens=4)
    assert len(warm) == 3 and all(r.arrival_s == 0.0 and r.max_tokens <= 4 for r in warm)
    assert all(r.replay_depths is not None and len(r.replay_depths) == r.max_tokens - 1 for r in warm)
