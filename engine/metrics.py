"""Prometheus metrics of one engine: the GenAI server, so its latencies are ``gen_ai_server_*``."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from engine.outputs import EngineStats
from meshkit.metrics import PER_TOKEN_BUCKETS, ComponentMetrics


class EngineMetrics(ComponentMetrics):
    component = "engine"

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        super().__init__(registry)
        self.time_to_first_token = self.histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
        )
        self.time_per_output_token = self.histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=PER_TOKEN_BUCKETS,
        )
        self.request_duration = self.histogram(
            "gen_ai_server_request_duration_seconds",
            "Time from a request's arrival to its last token.",
            ["finish_reason"],
        )
        self.waiting = self.gauge("waiting_requests", "Requests queued, preempted ones included.")
        self.running = self.gauge("running_requests", "Requests holding KV blocks.")
        self.kv_usage = self.gauge("kv_cache_usage_ratio", "KV blocks in use / blocks in the pool.")
        self.prefix_hit_ratio = self.gauge(
            "prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache / prompt tokens looked up, since start.",
        )
        self.prefix_queried = self.counter("prefix_cache_queried_tokens", "Prompt tokens looked up.")
        self.prefix_hits = self.counter("prefix_cache_hit_tokens", "Prompt tokens served from the cache.")
        self.preemptions = self.counter("preemptions", "Requests preempted (recomputed later).")
        self.queue_expired = self.counter(
            "queue_expired_requests",
            "Requests refused (RESOURCE_EXHAUSTED) after waiting past their queue limit without starting.",
        )
        self.generated_tokens = self.counter("generated_tokens", "Output tokens sampled.")
        self.prefill_pending = self.gauge(
            "prefill_pending_tokens", "Prompt tokens still to compute before their requests' first tokens."
        )
        self.step_fixed = self.gauge(
            "step_fixed_seconds", "A step's time apart from its tokens, as fitted over the recent steps."
        )
        self.step_token = self.gauge(
            "step_token_seconds", "A step's time for each token it computes, as fitted over the recent steps."
        )
        self.draft_tokens = self.counter(
            "speculative_draft_tokens",
            "Draft tokens proposed by prompt lookup and verified (accepted / this: the acceptance rate).",
        )
        self.accepted_draft_tokens = self.counter(
            "speculative_accepted_tokens", "Draft tokens the model's own pick agreed with (kept as output)."
        )
        self.speculating = self.gauge(
            "speculative_decoding_active", "1 when the latest step verified draft tokens, else 0."
        )
        self.grammar_compile = self.histogram(
            "grammar_compile_seconds",
            "Time to compile a request's output constraint not in the cache (waiting for a compile thread "
            "included), by outcome: compiled, or refused as invalid or unsupported.",
            ["outcome"],
        )
        self.grammar_cache_hits = self.counter(
            "grammar_cache_hits", "Constrained requests whose constraint was compiled already (no compile)."
        )
        # An embedding engine's (engine/embeddings): its batches, and what they computed.
        self.embed_batch = self.histogram(
            "embed_batch_seconds", "Time an embedding engine took to compute one batch of inputs."
        )
        self.embedded_inputs = self.counter(
            "embedded_inputs", "Inputs an embedding engine computed a vector for."
        )
        self.embedded_tokens = self.counter(
            "embedded_tokens", "Tokens of the inputs an embedding engine computed (special tokens included)."
        )
        self._last = EngineStats()

    def observe_embed_batch(self, inputs: int, tokens: int, seconds: float) -> None:
        self.embed_batch.observe(seconds)
        self.embedded_inputs.inc(inputs)
        self.embedded_tokens.inc(tokens)

    def observe_step(self, stats: EngineStats) -> None:
        last, self._last = self._last, stats
        self.waiting.set(stats.waiting_requests)
        self.running.set(stats.running_requests)
        self.kv_usage.set(stats.kv_usage)
        self.prefill_pending.set(stats.prefill_tokens)
        self.step_fixed.set(stats.step_fixed_s)
        self.step_token.set(stats.step_token_s)
        self.prefix_hit_ratio.set(stats.prefix_hit_ratio)
        self.prefix_queried.inc(stats.prefix_queried_tokens - last.prefix_queried_tokens)
        self.prefix_hits.inc(stats.prefix_hit_tokens - last.prefix_hit_tokens)
        self.preemptions.inc(stats.preemptions - last.preemptions)
        self.generated_tokens.inc(stats.generated_tokens - last.generated_tokens)
        self.draft_tokens.inc(stats.draft_tokens - last.draft_tokens)
        self.accepted_draft_tokens.inc(stats.accepted_draft_tokens - last.accepted_draft_tokens)
        self.speculating.set(int(stats.speculating))

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
