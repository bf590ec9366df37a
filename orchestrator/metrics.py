"""Prometheus metrics of the orchestrator (OpenTelemetry GenAI names where one applies).

TTFT and TPOT are measured here, where the user waits: from the moment a send arrives to its first
delta, and between deltas, so they include everything the orchestrator, router and engine add.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)

TIME_TO_FIRST_TOKEN = Histogram(
    "gen_ai_server_time_to_first_token_seconds",
    "From a request's arrival to its first answer text",
    ["gen_ai_request_model", "kind"],
    buckets=_LATENCY_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "gen_ai_server_time_per_output_token_seconds",
    "Mean time per output token after the first, per run",
    ["gen_ai_request_model"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1),
)
REQUEST_DURATION = Histogram(
    "gen_ai_server_request_duration_seconds",
    "From a run's start to its end",
    ["gen_ai_request_model", "status"],
    buckets=_LATENCY_BUCKETS,
)
TOKEN_USAGE = Histogram(
    "gen_ai_client_token_usage",
    "Tokens per run, by type (input: the assembled prompt; output: the answer)",
    ["gen_ai_request_model", "gen_ai_token_type"],
    buckets=_TOKEN_BUCKETS,
)
ACTIVE_RUNS = Gauge("chatmesh_orchestrator_active_runs", "Runs generating on this replica")
RUNS = Counter(
    "chatmesh_orchestrator_runs_total", "Runs ended on this replica", ["kind", "status", "finish_reason"]
)
BUDGET_REJECTIONS = Counter(
    "chatmesh_orchestrator_budget_rejections_total",
    "Requests refused because the user's token budget or concurrent-run limit was reached",
    ["tier", "limit"],
)
LIMIT_REJECTIONS = Counter(
    "chatmesh_orchestrator_limit_rejections_total", "Requests refused by a request limit", ["field"]
)
MODERATION_DECISIONS = Counter(
    "chatmesh_orchestrator_moderation_decisions_total",
    "Moderation decisions other than allow",
    ["stage", "category", "action"],
)
PROMPT_ASSEMBLY = Histogram(
    "chatmesh_orchestrator_prompt_assembly_seconds",
    "Reading history and fitting a prompt to the context window",
    buckets=_LATENCY_BUCKETS,
)
PROMPT_HISTORY = Counter(
    "chatmesh_orchestrator_prompts_total",
    "Assembled prompts by how history was fitted (verbatim, summary, truncated)",
    ["history"],
)
BACKGROUND_JOBS = Counter(
    "chatmesh_orchestrator_background_jobs_total",
    "Summaries and titles by outcome (done, failed, dropped)",
    ["kind", "outcome"],
)
CHECKPOINTS = Counter(
    "chatmesh_orchestrator_checkpoints_total", "Checkpoints of partial output written", ["outcome"]
)
ORPHANS_REAPED = Counter(
    "chatmesh_orchestrator_orphaned_runs_total", "Runs of lost replicas marked interrupted here"
)
SUBSCRIBERS = Gauge("chatmesh_orchestrator_run_subscribers", "Streams attached to runs on this replica")
