"""A front-end process's batch of per-token observations, applied with one update per bucket hit, gives the
scheduler's registry exactly what one ``observe`` per token gives."""

from __future__ import annotations

import math
import random

from services.telemetry.metrics import Metrics


def _series(metrics: Metrics) -> list[str]:
    return [
        line for line in metrics.render().splitlines() if line.startswith(("cdb_", "vllm:")) and "_created" not in line
    ]


def test_batched_itls_and_depths_equal_one_observation_each() -> None:
    rng = random.Random(7)
    one, batched = Metrics("m", 8, token_buckets=(0.001, 0.01, 0.1)), Metrics("m", 8, token_buckets=(0.001, 0.01, 0.1))
    itls = [rng.choice([0.001, 0.01, 0.1, 5.0]) if i % 3 == 0 else rng.uniform(0, 0.2) for i in range(300)]
    depths = [rng.randint(1, 8) for _ in range(300)]
    for seconds in itls:
        one.observe_itl(seconds)
    for depth in depths:
        one.observe_token_depth(depth)
    batched.observe_itls(itls[:100])
    batched.observe_itls(itls[100:])
    batched.observe_token_depths(depths)
    batched.observe_token_depths([])
    assert one.itl.count() == batched.itl.count() == 300
    a, b = _series(one), _series(batched)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if "_sum{" in x:  # added once per batch: equal up to rounding
            (kx, vx), (ky, vy) = x.rsplit(" ", 1), y.rsplit(" ", 1)
            assert kx == ky and math.isclose(float(vx), float(vy), rel_tol=1e-12)
        else:
            assert x == y
