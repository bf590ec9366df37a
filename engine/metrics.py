"""Prometheus metrics of one engine, named after the OpenTelemetry GenAI conventions where one exists."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from engine.outputs import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.time_to_first_token = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=_PER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.request_duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Time from a request's arrival to its last token.",
            ["finish_reason"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.waiting = Gauge(
            "chatmesh_engine_waiting_requests", "Requests queued, preempted ones included.", registry=registry
        )
        self.running = Gauge(
            "chatmesh_engine_running_requests", "Requests holding KV blocks.", registry=registry
        )
        self.kv_usage = Gauge(
            "chatmesh_engine_kv_cache_usage_ratio",
            "KV blocks in use / blocks in the pool.",
            registry=registry,
        )
        self.prefix_hit_ratio = Gauge(
            "chatmesh_engine_prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache / prompt tokens looked up, since start.",
            registry=registry,
        )
        self.prefix_queried = Counter(
            "chatmesh_engine_prefix_cache_queried_tokens", "Prompt tokens looked up.", registry=registry
        )
        self.prefix_hits = Counter(
            "chatmesh_engine_prefix_cache_hit_tokens",
            "Prompt tokens served from the cache.",
            registry=registry,
        )
        self.preemptions = Counter(
            "chatmesh_engine_preemptions", "Requests preempted (recomputed later).", registry=registry
        )
        self.generated_tokens = Counter(
            "chatmesh_engine_generated_tokens", "Output tokens sampled.", registry=registry
        )
        self._last = EngineStats()

    def observe_step(self, stats: EngineStats) -> None:
        last, self._last = self._last, stats
        self.waiting.set(stats.waiting_requests)
        self.running.set(stats.running_requests)
        self.kv_usage.set(stats.kv_usage)
        self.prefix_hit_ratio.set(stats.prefix_hit_ratio)
        self.prefix_queried.inc(stats.prefix_queried_tokens - last.prefix_queried_tokens)
        self.prefix_hits.inc(stats.prefix_hit_tokens - last.prefix_hit_tokens)
        self.preemptions.inc(stats.preemptions - last.preemptions)
        self.generated_tokens.inc(stats.generated_tokens - last.generated_tokens)

    def observe_finish(
        self,
        arrival: float,
        first_token_at: float | None,
        finished_at: float,
        new_tokens: int,
        finish_reason: str,
    ) -> None:
        self.request_duration.labels(finish_reason).observe(finished_at - arrival)
        if first_token_at is not None and new_tokens > 1:
            self.time_per_output_token.observe((finished_at - first_token_at) / (new_tokens - 1))
