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


def test_on_an_event_loop_a_token_is_tallied_at_the_end_of_its_iteration() -> None:
    """A streaming server's per-token observations are applied together once its loop iteration ends: the same
    series as one observation each; off a loop (or on another thread than the loop's) they are applied at once."""
    import asyncio
    import threading

    rng = random.Random(3)
    itls = [rng.uniform(0, 0.2) for _ in range(50)]
    depths = [rng.randint(1, 8) for _ in range(50)]
    one, tallied = Metrics("m", 8), Metrics("m", 8)
    for seconds, depth in zip(itls, depths):
        one.observe_itl(seconds)
        one.observe_token_depth(depth)
    assert one.itl.count() == 50  # off a loop: at once

    async def iteration() -> int:
        for seconds, depth in zip(itls, depths):
            tallied.observe_itl(seconds)
            tallied.observe_token_depth(depth)
        pending = tallied.itl.count()
        await asyncio.sleep(0)  # the iteration ends
        return pending

    assert asyncio.run(iteration()) == 0 and tallied.itl.count() == 50
    assert tallied.generated_tokens.value() == 50 and tallied.loop_steps.value() == sum(depths)
    a, b = _series(one), _series(tallied)
    assert [x.rsplit(" ", 1)[0] for x in a] == [y.rsplit(" ", 1)[0] for y in b]
    for x, y in zip(a, b):
        assert math.isclose(float(x.rsplit(" ", 1)[1]), float(y.rsplit(" ", 1)[1]), rel_tol=1e-12)

    other = threading.Thread(target=lambda: asyncio.run(_observe_one(tallied)))  # not the first loop's thread
    other.start()
    other.join()
    assert tallied.itl.count() == 51


async def _observe_one(metrics: Metrics) -> None:
    metrics.observe_itl(0.5)
    assert metrics.itl.count() == 51, "applied at once"
