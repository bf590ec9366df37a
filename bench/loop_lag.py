"""The event loop lag of the mesh's Python services, as their /metrics say it
(``chatmesh_event_loop_lag_seconds``, meshkit.event_loop): for a benchmark to show when a process's one
thread is full, and by how much, over any stretch of a run."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from meshkit.launcher import Launcher

METRIC = "chatmesh_event_loop_lag_seconds"
METRICS_FLAG = "--metrics-port"


@dataclass(frozen=True)
class LagHistogram:
    """One process's lag histogram as scraped: cumulative counts by upper bound, and the sum."""

    buckets: tuple[tuple[float, float], ...]
    total_s: float

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def since(self, earlier: LagHistogram) -> LagHistogram:
        before = dict(earlier.buckets)
        return LagHistogram(
            tuple((bound, count - before.get(bound, 0.0)) for bound, count in self.buckets),
            self.total_s - earlier.total_s,
        )

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0

    def quantile_bound(self, q: float) -> float:
        """The upper bound of the bucket holding the ``q`` quantile (inf past the last bound)."""
        for bound, count in self.buckets:
            if count >= q * self.count:
                return bound
        return math.inf


def metrics_ports(launcher: Launcher) -> dict[str, int]:
    """The launched services that serve /metrics, by name."""
    ports = {}
    for name, running in launcher.running.items():
        argv = running.spec.argv
        if METRICS_FLAG in argv:
            ports[name] = int(argv[argv.index(METRICS_FLAG) + 1])
    return ports


async def scrape(ports: Mapping[str, int], timeout_s: float = 5.0) -> dict[str, LagHistogram]:
    """Each process's lag histogram now (a process that does not answer in time is left out: a saturated
    one answers late, which its next scrape shows)."""

    async def one(client: httpx.AsyncClient, port: int) -> LagHistogram | None:
        try:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        except httpx.HTTPError:
            return None
        buckets, total = [], 0.0
        for family in text_string_to_metric_families(text):
            if family.name != METRIC:
                continue
            for sample in family.samples:
                if sample.name == f"{METRIC}_bucket":
                    buckets.append((float(sample.labels["le"]), sample.value))
                elif sample.name == f"{METRIC}_sum":
                    total = sample.value
        return LagHistogram(tuple(sorted(buckets)), total)

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        names = list(ports)
        found = await asyncio.gather(*(one(client, ports[name]) for name in names))
    return {name: histogram for name, histogram in zip(names, found, strict=True) if histogram is not None}


def describe(histogram: LagHistogram) -> str:
    """``mean / p99`` in milliseconds (the p99 as its bucket's bound)."""
    p99 = histogram.quantile_bound(0.99)
    bound = ">30000" if math.isinf(p99) else f"≤{p99 * 1000:g}"
    return f"{histogram.mean_s * 1000:.1f}/{bound}"
