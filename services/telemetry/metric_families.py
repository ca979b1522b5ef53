"""The ``prometheus_client`` metric kinds ``Metrics`` declares its series with: a counter, a gauge, a histogram
(label values passed positionally, children cached per label tuple) and a gauge exported only once set.

Label children are cached here: ``prometheus_client``'s own ``labels()`` lookup would add ≈0.6 µs per call.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Sequence
from typing import Any

import prometheus_client as prom
from prometheus_client.metrics_core import GaugeMetricFamily, Metric


class Family:
    """One ``prometheus_client`` metric, label values passed positionally, children cached per label tuple.

    ``fixed``: the values of the last label names, the same for every series (the served model), appended to the
    labels callers pass."""

    def __init__(self, metric: Any, name: str, label_names: Sequence[str], fixed: Sequence[str] = ()) -> None:
        self.metric, self.name, self.label_names, self.fixed = metric, name, tuple(label_names), tuple(fixed)
        self._children: dict[tuple[str, ...], Any] = {} if label_names else {(): metric}

    def child(self, labels: tuple[str, ...]) -> Any:
        """The series of ``labels`` (``labels()`` raises ValueError naming the label names on a wrong count)."""
        found = self._children.get(labels)
        if found is None:  # labels() is thread-safe and returns one child per tuple: a race stores the same one
            found = self._children.setdefault(labels, self.metric.labels(*labels, *self.fixed))
        return found

    def _sample(self, sample_name: str, labels: tuple[str, ...]) -> float:
        """The current value of one sample (reads and tests; not for the hot path)."""
        want = dict(zip(self.label_names, (*labels, *self.fixed)))
        for family in self.metric.collect():
            for s in family.samples:
                if s.name == sample_name and s.labels == want:
                    return float(s.value)
        return 0.0


class _Plain(Family):
    """A family of the ``prometheus_client`` kind ``kind`` (a counter or a gauge: no buckets)."""

    kind: Any

    def __init__(
        self,
        name: str,
        help_: str,
        label_names: Sequence[str] = (),
        *,
        registry: prom.CollectorRegistry,
        fixed: Sequence[str] = (),
    ) -> None:
        super().__init__(self.kind(name, help_, label_names, registry=registry), name, label_names, fixed)


class Counter(_Plain):
    """Monotonic count, per label values. ``name`` ends in ``_total``, as exposed."""

    kind = prom.Counter

    def __init__(self, name: str, help_: str, *args: Any, **kwargs: Any) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter names end in _total: {name!r}")
        super().__init__(name, help_, *args, **kwargs)

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        self.child(labels).inc(amount)

    def value(self, *labels: str) -> float:
        return self._sample(self.name, labels)


class Gauge(_Plain):
    """Value that goes up and down (``set``), per label values."""

    kind = prom.Gauge

    def set(self, value: float, *labels: str) -> None:
        self.child(labels).set(value)

    def remove(self, *labels: str) -> None:
        """Drop the series of ``labels`` (no-op when it does not exist)."""
        if self._children.pop(labels, None) is not None:
            self.metric.remove(*labels, *self.fixed)

    def value(self, *labels: str) -> float:
        return self._sample(self.name, labels)


class OptionalGauge:
    """A gauge exported only once ``set`` (where a 0 before then would read as a real value); ``labels``: the
    fixed labels of its one series (the served model)."""

    def __init__(
        self, name: str, help_: str, *, registry: prom.CollectorRegistry, labels: dict[str, str] | None = None
    ) -> None:
        self.name, self.help, self.labels = name, help_, dict(labels or {})
        self._value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self._value = float(value)

    def value(self) -> float | None:
        return self._value

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.help)]

    def collect(self) -> list[Metric]:
        value = self._value
        if value is None:
            return []
        family = GaugeMetricFamily(self.name, self.help, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return [family]


class Histogram(Family):
    """Cumulative-bucket histogram (upper bounds inclusive, Prometheus' ``le``), per label values."""

    def __init__(
        self,
        name: str,
        help_: str,
        buckets: Iterable[float],
        label_names: Sequence[str] = (),
        *,
        registry: prom.CollectorRegistry,
        fixed: Sequence[str] = (),
    ) -> None:
        self.bounds = tuple(sorted(float(b) for b in buckets))
        metric = prom.Histogram(name, help_, label_names, registry=registry, buckets=self.bounds)
        super().__init__(metric, name, label_names, fixed)

    def observe(self, value: float, *labels: str) -> None:
        self.child(labels).observe(value)

    def observe_many(self, values: Sequence[float], *labels: str) -> None:
        """``observe`` of every value, one bucket update per bucket hit (a front end's batch of observations; the
        sum is added once, so it may differ from one-by-one addition in the last bits). Reaches into
        ``prometheus_client``'s histogram child (its bounds, buckets and sum; the version is pinned and
        ``tests/telemetry/test_bulk_observations.py`` compares this with ``observe``)."""
        if not values:
            return
        child = self.child(labels)
        bounds = child._upper_bounds
        for index, n in collections.Counter(bisect.bisect_left(bounds, v) for v in values).items():
            child._buckets[index].inc(n)
        child._sum.inc(sum(values))

    def count(self, *labels: str) -> int:
        return int(self._sample(self.name + "_count", labels))

    def sum(self, *labels: str) -> float:
        return self._sample(self.name + "_sum", labels)
