"""Percentiles from Prometheus histograms: how many observations fell in each bucket between two scrapes,
then Prometheus's own ``histogram_quantile`` (linear interpolation inside the bucket)."""

from __future__ import annotations

import math
from collections import defaultdict

from edge.ops.scrape import Round


def increase(before: float | None, after: float) -> float:
    """A counter's increase between two scrapes; a restarted process starts again from zero."""
    if before is None or after < before:
        return after
    return after - before


def bucket_increases(
    before: Round, after: Round, histogram: str, of_target: str | None = None
) -> dict[float, float]:
    """Cumulative observations of ``histogram`` by upper bound between two consecutive rounds, summed
    over every target (or only ``of_target``) and label set (consecutive, so a restart in between loses
    nothing before it)."""
    name = f"{histogram}_bucket"
    earlier = {(target, labels): value for target, labels, value in before.series(name)}
    counts: dict[float, float] = defaultdict(float)
    for target, labels, value in after.series(name):
        if of_target is None or target == of_target:
            counts[float(dict(labels)["le"])] += increase(earlier.get((target, labels)), value)
    return counts


def counter_increase(before: Round, after: Round, name: str) -> float:
    """How much counter ``name`` grew between two consecutive rounds, over every target and label set."""
    earlier = {(target, labels): value for target, labels, value in before.series(name)}
    return sum(increase(earlier.get((target, labels)), value) for target, labels, value in after.series(name))


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``buckets``; None without observations. Past the last finite
    bound it answers that bound (as Prometheus does)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
