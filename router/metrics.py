"""Prometheus metrics of the router (``chatmesh_router_*``; meshkit.metrics).

Per-engine gauges are read from the registry's engine states when scraped (a collector), so they are
never stale and disappear with the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from meshkit.metrics import ComponentMetrics
from router.engines import EngineState


class RouterMetrics(ComponentMetrics):
    component = "router"

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        super().__init__(registry)
        self.decisions = self.counter("decisions", "Placements made, by policy.", ["policy"])
        self.prompt_tokens = self.counter(
            "prompt_tokens",
            "Context tokens of placements that finished (compare the cached-token counters with it).",
        )
        self.predicted_cached_tokens = self.counter(
            "predicted_cached_tokens", "Prompt tokens the index predicted the chosen engine had cached."
        )
        self.cached_tokens = self.counter(
            "cached_tokens",
            "Prompt tokens the chosen engine actually served from its cache (its finished usage).",
        )
        self.hinted = self.counter(
            "session_hinted_placements",
            "Placements where the session's last engine was credited with blocks the index had not "
            "heard of yet (router/sessions.py).",
        )
        self.failovers = self.counter(
            "failovers", "Requests re-placed on another engine, by what went wrong.", ["reason"]
        )
        self.shed = self.counter(
            "shed_requests", "Requests refused with RESOURCE_EXHAUSTED under overload, by tier.", ["tier"]
        )
        self.queue_expired = self.counter(
            "queue_expired_requests",
            "Admitted requests an engine dropped from its queue unstarted when their TTFT objective ran "
            "out, refused with RESOURCE_EXHAUSTED, by tier (the wait rule's mispredictions).",
            ["tier"],
        )
        self.degraded = self.counter(
            "degraded_requests",
            "Free-tier requests sent to a cheaper model's pool because their model's pool was past the "
            "free tier's threshold, by model asked for and model served.",
            ["model", "served_model"],
        )
        self.kv_resyncs = self.counter(
            "kv_resyncs",
            "Times an engine's index was rebuilt from a snapshot, by cause (gap, overflow).",
            ["engine", "reason"],
        )
        # The engines' gen_ai_server_* latencies plus placement, queueing at the router and failovers.
        self.time_to_first_token = self.histogram(
            "time_to_first_token_seconds",
            "Time from a request's arrival at the router to its first output token leaving it.",
        )
        self.request_duration = self.histogram(
            "request_duration_seconds",
            "Time from a request's arrival at the router to its end.",
            ["finish_reason"],
        )

    def watch_engines(self, engines: Callable[[], Iterable[tuple[EngineState, int]]]) -> None:
        """Exports per-engine gauges from ``engines()``: each engine with its indexed block count."""
        self.registry.register(_EngineCollector(engines, self.name("engine_")))


class _EngineCollector(Collector):
    def __init__(self, engines: Callable[[], Iterable[tuple[EngineState, int]]], prefix: str) -> None:
        self._engines = engines
        self._prefix = prefix  # chatmesh_router_engine_

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "healthy": GaugeMetricFamily(
                self._prefix + "healthy", "1 if the engine takes work.", labels=["engine"]
            ),
            "waiting": GaugeMetricFamily(
                self._prefix + "waiting_requests", "Queued requests (last report).", labels=["engine"]
            ),
            "running": GaugeMetricFamily(
                self._prefix + "running_requests",
                "Running requests (last report).",
                labels=["engine"],
            ),
            "kv_usage": GaugeMetricFamily(
                self._prefix + "kv_cache_usage_ratio",
                "KV blocks in use (last report).",
                labels=["engine"],
            ),
            "inflight": GaugeMetricFamily(
                self._prefix + "inflight_requests",
                "This router's requests on the engine.",
                labels=["engine"],
            ),
            "blocks": GaugeMetricFamily(
                self._prefix + "indexed_blocks",
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
