"""Prometheus metrics of the router, named after the OpenTelemetry GenAI conventions where one exists.

Per-engine gauges are read from the registry's engine states when scraped (a collector), so they are
never stale and disappear with the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.engines import EngineState

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.decisions = Counter(
            "chatmesh_router_decisions", "Placements made, by policy.", ["policy"], registry=registry
        )
        self.prompt_tokens = Counter(
            "chatmesh_router_prompt_tokens",
            "Context tokens of placements that finished (compare the cached-token counters with it).",
            registry=registry,
        )
        self.predicted_cached_tokens = Counter(
            "chatmesh_router_predicted_cached_tokens",
            "Prompt tokens the index predicted the chosen engine had cached.",
            registry=registry,
        )
        self.cached_tokens = Counter(
            "chatmesh_router_cached_tokens",
            "Prompt tokens the chosen engine actually served from its cache (its finished usage).",
            registry=registry,
        )
        self.failovers = Counter(
            "chatmesh_router_failovers",
            "Requests re-placed on another engine, by what went wrong.",
            ["reason"],
            registry=registry,
        )
        self.shed = Counter(
            "chatmesh_router_shed_requests",
            "Requests refused with RESOURCE_EXHAUSTED under overload, by tier.",
            ["tier"],
            registry=registry,
        )
        self.kv_resyncs = Counter(
            "chatmesh_router_kv_resyncs",
            "Times an engine's index was rebuilt from a snapshot, by cause (gap, overflow).",
            ["engine", "reason"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time from a request's arrival at the router to its first output token leaving it.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.request_duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Time from a request's arrival at the router to its end.",
            ["finish_reason"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

    def watch_engines(self, engines: Callable[[], Iterable[tuple[EngineState, int]]]) -> None:
        """Exports per-engine gauges from ``engines()``: each engine with its indexed block count."""
        self.registry.register(_EngineCollector(engines))


class _EngineCollector(Collector):
    def __init__(self, engines: Callable[[], Iterable[tuple[EngineState, int]]]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "healthy": GaugeMetricFamily(
                "chatmesh_router_engine_healthy", "1 if the engine takes work.", labels=["engine"]
            ),
            "waiting": GaugeMetricFamily(
                "chatmesh_router_engine_waiting_requests", "Queued requests (last report).", labels=["engine"]
            ),
            "running": GaugeMetricFamily(
                "chatmesh_router_engine_running_requests",
                "Running requests (last report).",
                labels=["engine"],
            ),
            "kv_usage": GaugeMetricFamily(
                "chatmesh_router_engine_kv_cache_usage_ratio",
                "KV blocks in use (last report).",
                labels=["engine"],
            ),
            "inflight": GaugeMetricFamily(
                "chatmesh_router_engine_inflight_requests",
                "This router's requests on the engine.",
                labels=["engine"],
            ),
            "blocks": GaugeMetricFamily(
                "chatmesh_router_engine_indexed_blocks",
                "Block hashes the index holds for it.",
                labels=["engine"],
            ),
        }
        for engine, indexed_blocks in self._engines():
            load = engine.load
            labels = [engine.engine_id]
            families["healthy"].add_metric(labels, 1.0 if engine.healthy else 0.0)
            families["waiting"].add_metric(labels, load.waiting_requests if load else 0)
            families["running"].add_metric(labels, load.running_requests if load else 0)
            families["kv_usage"].add_metric(labels, load.kv_usage if load else 0)
            families["inflight"].add_metric(labels, len(engine.inflight))
            families["blocks"].add_metric(labels, indexed_blocks)
        yield from families.values()
