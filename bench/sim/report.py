"""What a simulation run measured: the router's real costs and the simulated service's behaviour."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.sim.setup import Setup
from router.admission import is_premium

if TYPE_CHECKING:
    from bench.sim.engine import Request

TIERS = ("free", "paid")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class TierStats:
    arrived: int = 0
    shed: int = 0
    finished: int = 0
    ttft_s: list[float] = field(default_factory=list)  # of requests arriving in the measured window
    prompt_tokens: int = 0  # of finished requests in the window
    cached_tokens: int = 0


@dataclass
class Report:
    setup: Setup
    measure_from: float
    tiers: dict[str, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})
    decision_s: list[float] = field(default_factory=list)
    predicted_exact: int = 0
    failovers: int = 0
    # Filled by finish():
    wall_s: float = 0.0
    simulated_s: float = 0.0
    lost: int = 0
    peak_streams: int = 0
    index_bytes: int = 0  # when arrivals stopped (the index at its fullest)
    indexed_blocks: int = 0
    ingest: list[tuple[float, int, int]] = field(default_factory=list)  # per replica: seconds, blocks, events
    replicas_agree: bool = True
    hinted: int = 0  # placements a session hint changed the input of (router/sessions.py)

    # -- recording (the simulation calls these) ------------------------------------------------------

    def _tier(self, request: Request) -> TierStats:
        return self.tiers["paid" if is_premium(request.tier) else "free"]

    def arrived(self, request: Request) -> None:
        self._tier(request).arrived += 1

    def decision(self, seconds: float) -> None:
        self.decision_s.append(seconds)

    def shed(self, request: Request) -> None:
        self._tier(request).shed += 1

    def failed_over(self, request: Request) -> None:
        self.failovers += 1

    def streams(self, open_streams: int) -> None:
        self.peak_streams = max(self.peak_streams, open_streams)

    def finished(self, request: Request) -> None:
        tier = self._tier(request)
        tier.finished += 1
        if request.arrival < self.measure_from:
            return
        tier.ttft_s.append(request.first_token - request.arrival)
        tier.prompt_tokens += request.prompt_tokens
        tier.cached_tokens += request.cached_tokens
        self.predicted_exact += request.predicted_cached_tokens == request.cached_tokens

    def finish(
        self,
        simulated_s: float,
        wall_s: float,
        ingest: list[tuple[float, int, int]],
        replicas_agree: bool,
        hinted: int,
    ) -> None:
        """The run's end: how long it took, each router's KV event ingestion (seconds, blocks, events),
        whether every router's index ended the same, and how many placements a session hint changed."""
        self.wall_s = wall_s
        self.simulated_s = simulated_s
        arrived = sum(t.arrived for t in self.tiers.values())
        done = sum(t.finished + t.shed for t in self.tiers.values())
        self.lost = arrived - done
        self.ingest = ingest
        self.replicas_agree = replicas_agree
        self.hinted = hinted

    # -- figures --------------------------------------------------------------------------------------

    @property
    def hit_rate(self) -> float:
        prompt = sum(t.prompt_tokens for t in self.tiers.values())
        return sum(t.cached_tokens for t in self.tiers.values()) / prompt if prompt else 0.0

    def decision_us(self, q: float) -> float:
        return percentile(self.decision_s, q) * 1e6

    def shed_rate(self, tier: str) -> float:
        stats = self.tiers[tier]
        return stats.shed / stats.arrived if stats.arrived else 0.0

    def ingest_blocks_per_s(self) -> float:
        """Index updates one router core absorbs per second (blocks of KV events, stored or removed)."""
        seconds = sum(s for s, _, _ in self.ingest)
        return sum(b for _, b, _ in self.ingest) / seconds if seconds else 0.0

    def event_blocks_per_simulated_s(self) -> float:
        """Blocks of KV events the engines published per simulated second (what each replica ingests)."""
        _, blocks, _ = self.ingest[0]
        return blocks / self.simulated_s if self.simulated_s else 0.0

    def summary(self) -> dict[str, object]:
        finished = sum(t.finished for t in self.tiers.values())
        row = {
            "policy": self.setup.policy,
            "load": self.setup.workload.load,
            "engines": self.setup.engines,
            "routers": self.setup.routers,
            "requests": sum(t.arrived for t in self.tiers.values()),
            "finished": finished,
            "lost": self.lost,
            "failovers": self.failovers,
            "peak_streams": self.peak_streams,
            "decision_us_p50": self.decision_us(0.5),
            "decision_us_p99": self.decision_us(0.99),
            "decision_us_mean": statistics.fmean(self.decision_s) * 1e6 if self.decision_s else 0.0,
            "hit_rate": self.hit_rate,
            "predicted_exact": self.predicted_exact / max(1, sum(len(t.ttft_s) for t in self.tiers.values())),
            "index_mib": self.index_bytes / 2**20,
            "indexed_blocks": self.indexed_blocks,
            "index_bytes_per_block": self.index_bytes / max(1, self.indexed_blocks),
            "ingest_blocks_per_core_s": self.ingest_blocks_per_s(),
            "event_blocks_per_s": self.event_blocks_per_simulated_s(),
            "replicas_agree": self.replicas_agree,
            "event_lag_s": self.setup.event_lag_s,
            "session_hints": self.setup.session_hints,
            "think_s": self.setup.workload.think_s,
            "hinted": self.hinted / max(1, len(self.decision_s)),
            "simulated_s": self.simulated_s,
            "wall_s": self.wall_s,
        }
        for name, stats in self.tiers.items():
            row[f"ttft_{name}_p50_s"] = percentile(stats.ttft_s, 0.5)
            row[f"ttft_{name}_p99_s"] = percentile(stats.ttft_s, 0.99)
            row[f"shed_{name}"] = self.shed_rate(name)
        return row
