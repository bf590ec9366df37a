"""Prometheus metrics of the orchestrator (``chatmesh_orchestrator_*``; meshkit.metrics).

TTFT and TPOT are measured here, where the user waits: from the moment a send arrives to its first
delta, and between deltas, so they include everything the orchestrator, router and engine add (the
engine's own are ``gen_ai_server_*``). ``METRICS`` is the process's instance.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from meshkit.metrics import ComponentMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
# The outcomes of a tool call (tool_calls_total's help says what each means).
TOOL_OUTCOMES = ("ok", "error", "timeout", "refused", "interrupted")


class OrchestratorMetrics(ComponentMetrics):
    component = "orchestrator"

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        super().__init__(registry)
        self.time_to_first_token = self.histogram(
            "time_to_first_token_seconds",
            "From a request's arrival to its first answer text",
            ["gen_ai_request_model", "kind", "tier"],
            _LATENCY_BUCKETS,
        )
        self.time_per_output_token = self.histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per run",
            ["gen_ai_request_model", "tier"],
            (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1),
        )
        self.run_duration = self.histogram(
            "run_duration_seconds",
            "From a run's start to its end",
            ["gen_ai_request_model", "status"],
            _LATENCY_BUCKETS,
        )
        # The orchestrator is the GenAI client of the router and engines.
        self.token_usage = self.histogram(
            "gen_ai_client_token_usage",
            "Tokens per run, by type (input: the assembled prompt; output: the answer)",
            ["gen_ai_request_model", "gen_ai_token_type"],
            _TOKEN_BUCKETS,
        )
        self.active_runs = self.gauge("active_runs", "Runs generating on this replica")
        self.runs = self.counter(
            "runs_total",
            "Runs ended on this replica, by the model that answered",
            ["kind", "status", "finish_reason", "gen_ai_request_model"],
        )
        self.budget_rejections = self.counter(
            "budget_rejections_total",
            "Requests refused because the user's token budget or concurrent-run limit was reached, by "
            "the model they asked for (its --model-budget, or the tier's budget)",
            ["tier", "limit", "gen_ai_request_model"],
        )
        self.budget_tokens = self.counter(
            "budget_tokens_total",
            "Tokens (prompt + completion) ended runs charged to their users' budgets, by tier and the "
            "model that answered",
            ["tier", "gen_ai_request_model"],
        )
        self.limit_rejections = self.counter(
            "limit_rejections_total", "Requests refused by a request limit", ["field"]
        )
        self.moderation_decisions = self.counter(
            "moderation_decisions_total",
            "Moderation decisions other than allow",
            ["stage", "category", "action"],
        )
        self.prompt_assembly = self.histogram(
            "prompt_assembly_seconds",
            "Reading history and fitting a prompt to the context window, by the model prompted (its "
            "tokenizer and template)",
            ["gen_ai_request_model"],
            _LATENCY_BUCKETS,
        )
        self.prompt_history = self.counter(
            "prompts_total",
            "Assembled prompts by how history was fitted (verbatim, summary, truncated), by model",
            ["history", "gen_ai_request_model"],
        )
        self.background_jobs = self.counter(
            "background_jobs_total",
            "Summaries and titles by outcome (done, failed, dropped)",
            ["kind", "outcome"],
        )
        self.checkpoints = self.counter(
            "checkpoints_total", "Checkpoints of partial output written", ["outcome"]
        )
        self.orphans_reaped = self.counter(
            "orphaned_runs_total",
            "Runs of lost replicas taken over here, by outcome (adopted: continued here; interrupted: "
            "ended with their checkpointed output, having no stored generation to continue from; "
            "settled: ended by their replica, which died before storing the answer it had)",
            ["outcome"],
        )
        self.strays_reaped = self.counter(
            "stray_runs_total",
            "Runs of this replica it found it did not have in hand (a start that failed after its run "
            "landed, a lost give-back or interrupt write), taken up by its reaper, by outcome "
            "(continued: generated on here; settled: ended, with what the end leaves now stored)",
            ["outcome"],
        )
        self.runs_left = self.counter(
            "runs_left_total",
            "Runs this replica left to another one (handed_over at shutdown, superseded: adopted "
            "elsewhere while this replica was unreachable)",
            ["reason"],
        )
        self.late_ends = self.gauge(
            "late_run_ends_waiting",
            "Run ends not stored within --finish-retry-s, which this replica keeps trying to store",
        )
        self.late_ends_done = self.counter(
            "late_run_ends_total",
            "Late run ends no longer waiting, by outcome (stored; taken_over: the run is another "
            "replica's now; dropped: refused by the store, logged)",
            ["outcome"],
        )
        self.router_failovers = self.counter(
            "router_failovers_total", "Answers that went on through another router after theirs failed"
        )
        self.tool_calls = self.counter(
            "tool_calls_total",
            "Calls of the orchestrator's own tools and its MCP servers' (SERVER.TOOL), by tool and outcome "
            "(ok, error, timeout, refused; interrupted: found started after its replica was lost, never "
            "run again)",
            ["tool", "outcome"],
        )
        self.mcp_server_up = self.gauge(
            "mcp_server_up",
            "1 while the MCP server (--mcp-server NAME) answered its last tool listing, else 0: its tools "
            "are offered only while it is up",
            ["server"],
        )
        self.mcp_server_tools = self.gauge(
            "mcp_server_tools", "Tools the MCP server listed last that can be offered", ["server"]
        )
        self.tool_duration = self.histogram(
            "tool_duration_seconds",
            "How long a tool call ran, whatever its outcome",
            ["tool"],
            _LATENCY_BUCKETS,
        )
        self.subscribers = self.gauge("run_subscribers", "Streams attached to runs on this replica")
        self.stream_interval = self.gauge(
            "stream_interval_seconds",
            "How long a stream's deltas gather before they leave as one event, now: 0 while this "
            "replica's event loop keeps up, about twice its lag once it runs late (--stream-interval-max-ms)",
        )


METRICS = OrchestratorMetrics()
