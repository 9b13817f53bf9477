"""Counters and histograms that only the event loop's thread updates: the per-request and per-token metrics.

prometheus-client's own ``Counter`` and ``Histogram`` take a lock on every update (a histogram observation is two
locked increments after a linear walk of the buckets, about 2 µs; a ``labels(...)`` lookup about 2 µs more). The
request path makes about a dozen such updates per streamed request (one inter-token gap per token), which measured
about 5% of the gateway's CPU per request (``bench.gateway_bench --profile``). These hold plain numbers instead —
every update comes from the one thread that runs the event loop, so no lock is needed — and a
:class:`LoopMetricsCollector` hands them to prometheus-client at scrape time as ordinary metric families, so the
exposition (names, ``_bucket`` / ``_sum`` / ``_count`` / ``_total`` series, ``le`` labels) is prometheus-client's.
Not exported: the ``_created`` series of these counters and histograms.

Updating one from another thread is a bug (lost increments), not an error that is raised.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

SeriesT = TypeVar("SeriesT")


class LoopHistogram:
    """One histogram series: counts per bucket (``value <= bound``, the last bound +Inf) and the sum.

    Args:
        upper_bounds: the finite upper bounds, ascending (+Inf is added).
    """

    __slots__ = ("upper_bounds", "counts", "sum")

    def __init__(self, upper_bounds: Sequence[float]) -> None:
        self.upper_bounds = (*upper_bounds, math.inf)
        self.counts = [0] * len(self.upper_bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (seconds, tokens: whatever the family measures)."""
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """Return ``(le, count of observations <= le)`` per bound, as the exposition format wants them."""
        total = 0
        buckets = []
        for bound, count in zip(self.upper_bounds, self.counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        return buckets


class LoopCounter:
    """One counter series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (not negative)."""
        self.value += amount


class _LoopFamily(Generic[SeriesT]):
    """A metric's series by label values (one, without labels), made by ``new_series`` on first use.

    Args:
        name: the metric name.
        documentation: its help text.
        labelnames: label names; none = a single series, used through the subclass's update method.
        new_series: makes an empty series.
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 new_series: Callable[[], SeriesT]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._new_series = new_series
        self._series: dict[tuple[str, ...], SeriesT] = {}
        if not self.labelnames:
            self._single = self._series[()] = new_series()

    def labels(self, *values: str) -> SeriesT:
        """Return the series of these label values (made on first use)."""
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            series = self._series[values] = self._new_series()
        return series


class LoopHistogramFamily(_LoopFamily[LoopHistogram]):
    """A histogram metric: one :class:`LoopHistogram` per label values (or one, without labels).

    Args:
        name: the metric name (``sluice_ttft_seconds``).
        documentation: its help text.
        buckets: the finite upper bounds, ascending.
        labelnames: label names; none = a single series used through :meth:`observe`.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = ()) -> None:
        self.buckets = tuple(buckets)
        super().__init__(name, documentation, labelnames, lambda: LoopHistogram(self.buckets))

    def observe(self, value: float) -> None:
        """Observe on the single series of a family without labels."""
        self._single.observe(value)

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in self._series.items():
            family.add_metric(list(values), series.cumulative(), series.sum)
        return family


class LoopCounterFamily(_LoopFamily[LoopCounter]):
    """A counter metric: one :class:`LoopCounter` per label values (or one, without labels).

    Args:
        name: the metric name without ``_total`` (``sluice_requests``).
        documentation: its help text.
        labelnames: label names; none = a single series used through :meth:`inc`.
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames, LoopCounter)

    def inc(self, amount: float = 1.0) -> None:
        """Add to the single series of a family without labels."""
        self._single.value += amount

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in self._series.items():
            family.add_metric(list(values), series.value)
        return family


class LoopMetricsCollector:
    """A prometheus-client collector of loop-owned families (register it once in a ``CollectorRegistry``).

    Args:
        families: the families, in the order they are exposed.
    """

    def __init__(self, families: Iterable[LoopHistogramFamily | LoopCounterFamily]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        """Yield each family's current values (called by the registry on every scrape)."""
        for family in self._families:
            yield family.family()
