"""The benchmarks' one place for sample summaries: each order statistic the benchmarks report picks the rank it
always picked, ranges skip unknown values, and the run of median rank is a whole run."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest

from cdb_bench.processes import free_address, free_port, with_public_caps
from cdb_bench.stats import error_bars, median, median_min_max, median_range, middle, order_statistic, percentile

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 11, 199, 200, 201])
def test_order_statistics_pick_the_ranks_of_each_rounding(n: int) -> None:
    xs = list(range(n))[::-1]  # unsorted on purpose
    ranked = sorted(xs)
    assert order_statistic(xs, 0.5, math.ceil) == ranked[n // 2]  # the upper middle
    assert order_statistic(xs, 0.9, math.ceil) == ranked[int(n * 0.9)]
    assert order_statistic(xs, 0.9, math.floor) == ranked[int(0.9 * (n - 1))]
    assert order_statistic(xs, 0.99) == ranked[min(n - 1, round(0.99 * (n - 1)))]
    assert order_statistic(xs, 1.0) == ranked[-1]


def test_no_values_have_no_order_statistic_or_percentile() -> None:
    with pytest.raises(ValueError):
        order_statistic([], 0.5)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_interpolates_between_order_statistics() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0], 100) == 2.0


def test_medians_and_ranges_skip_unknown_values() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([None, None]) is None
    assert median_range([0.7, None, 0.2, 0.6]) == {"median": 0.6, "min": 0.2, "max": 0.7}
    assert median_range([None]) == {"median": None, "min": None, "max": None}
    assert median_min_max([2.0, 8.0, 4.0, 6.0]) == (5.0, 2.0, 8.0)


def test_the_middle_run_is_the_upper_of_two_and_error_bars_reach_the_extremes() -> None:
    runs = [{"tok": 3.0}, {"tok": 1.0}, {"tok": 4.0}, {"tok": 2.0}]
    assert middle(runs, key=lambda r: r["tok"]) == {"tok": 3.0}
    assert error_bars([[1.0, 2.0, 4.0], [5.0]]) == [[1.0, 0.0], [2.0, 0.0]]


def test_a_free_port_can_be_bound_and_the_public_caps_only_grow() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
    assert free_address().startswith("127.0.0.1:")
    assert with_public_caps({"CDB_MAX_CONCURRENT_RPCS": "4096", "X": "1"}, 100) == {
        "CDB_MAX_CONCURRENT_RPCS": "4096",
        "CDB_MAX_REQUESTS_PER_CALLER": "164",  # (the benchmark's client is one caller)
        "X": "1",
    }
    assert with_public_caps({}, 2000)["CDB_MAX_CONCURRENT_RPCS"] == "2064"
    assert with_public_caps({"CDB_MAX_REQUESTS_PER_CALLER": "7"}, 2000)["CDB_MAX_REQUESTS_PER_CALLER"] == "7", "as set"


def test_a_free_port_is_never_one_the_kernel_hands_to_a_bind_to_port_0() -> None:
    """The servers of a tree bind port 0 for their listeners; a port handed out for a later bind must not be one of
    those (the kernel's ephemeral range), nor handed out twice."""
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(1024 < p < start for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # what a server binding port 0 gets
        assert s.getsockname()[1] >= start
