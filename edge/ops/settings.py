"""The operations page's settings: which ``/metrics`` endpoints to scrape, how often, how much history to
keep, and where the mesh's spans are (all ``python -m edge`` flags, meshkit.config)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from meshkit.config import setting


@dataclass(frozen=True)
class MetricsTarget:
    """One service's Prometheus endpoint. An engine's name must be its engine id (the router's name for
    it), so the page can put the engine's own numbers next to the router's view of it."""

    name: str
    url: str

    @classmethod
    def parse(cls, spec: str) -> MetricsTarget:
        name, sep, url = spec.strip().partition("=")
        parsed = urlparse(url)
        if not sep or not name or parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(
                f"--ops-metrics-target must look like name=http://host:port/metrics, got {spec!r}"
            )
        return cls(name, url)


def _targets(specs: list[str]) -> tuple[MetricsTarget, ...]:
    targets = tuple(MetricsTarget.parse(spec) for spec in specs)
    names = [target.name for target in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"--ops-metrics-target names must differ, got {names}")
    return targets


@dataclass(frozen=True)
class OpsSettings:
    metrics_targets: tuple[MetricsTarget, ...] = setting(
        (),
        "name=url of a service's Prometheus /metrics for the operations page (repeat for each service)",
        flag="ops-metrics-target",
        flag_default=[],
        parse=_targets,
        repeat=True,
    )
    scrape_interval_s: float = setting(
        2.0, "how often the operations page's targets are scraped", flag="ops-scrape-interval-s"
    )
    # Enough for the latency charts' "last minutes"; memory is targets x samples x history / interval.
    history_s: float = setting(600.0, "seconds of scraped history kept for the charts", flag="ops-history-s")
    # The JSON-lines span file the services write (CHATMESH_TRACE_FILE) and the local OTLP collector
    # appends Envoy's spans to; empty: the page cannot look up traces.
    trace_file: str = setting("", "span file (JSON lines) to look runs' traces up in", flag="ops-trace-file")

    def __post_init__(self) -> None:
        if self.scrape_interval_s <= 0 or self.history_s < self.scrape_interval_s:
            raise ValueError("--ops-scrape-interval-s must be > 0 and --ops-history-s at least one interval")
