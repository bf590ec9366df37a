"""Writes the Helm chart's Grafana dashboards (helm/chatmesh/dashboards/*.json) from the panels below.

    .venv/bin/python scripts/grafana_dashboards.py          # rewrite the JSON files
    .venv/bin/python scripts/grafana_dashboards.py --check  # exit 1 if they differ from this script

Every query reads metrics the services export (tests/helm/test_observability_metrics.py scrapes a
running mesh to prove it). Every panel filters on the `$namespace` variable (the release's namespace,
a target label the ServiceMonitors give every series). docs/operations/monitoring.md describes the dashboards.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "helm" / "chatmesh" / "dashboards"
NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    stacked: bool = False


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    panels: list[Panel] = field(default_factory=list)


def quantiles(metric: str, by: str, selector: str = NS) -> tuple[Target, ...]:
    """p50 and p99 of a histogram, one line per value of ``by`` (if any)."""
    group = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"{legend}p{round(q * 100)}",
        )
        for q in (0.5, 0.99)
    )


def rate_by(metric: str, by: str, extra: str = "") -> Target:
    selector = f"{NS}, {extra}" if extra else NS
    return Target(f"sum by ({by}) (rate({metric}{{{selector}}}[{RATE}]))", f"{{{{{by}}}}}")


def door() -> Dashboard:
    return Dashboard(
        "chatmesh-door",
        "chatmesh / Door",
        "What users see: requests and errors at the edge, time to first token and per output token.",
        [
            Panel(
                "Requests by route",
                "HTTP requests the edge answered, per second (Envoy's own 429s never reach it).",
                "reqps",
                (rate_by("chatmesh_edge_http_requests_total", "route"),),
                stacked=True,
            ),
            Panel(
                "Errors by status code",
                "4xx and 5xx responses of the edge per second, by status.",
                "reqps",
                (rate_by("chatmesh_edge_http_requests_total", "status", 'status=~"[45].."'),),
                stacked=True,
            ),
            Panel(
                "TTFT by kind (orchestrator)",
                "From a send's arrival to its first answer text (the TTFT objective's measure), by run kind.",
                "s",
                quantiles("chatmesh_orchestrator_time_to_first_token_seconds", "kind"),
            ),
            Panel(
                "TTFT by tier (orchestrator)",
                "From a send's arrival to its first answer text, by the caller's tier: paid tiers first.",
                "s",
                quantiles("chatmesh_orchestrator_time_to_first_token_seconds", "tier"),
            ),
            Panel(
                "TPOT by model (orchestrator)",
                "Mean time per output token after the first, per run, by model.",
                "s",
                quantiles("chatmesh_orchestrator_time_per_output_token_seconds", "gen_ai_request_model"),
            ),
            Panel(
                "TPOT by tier (orchestrator)",
                "Mean time per output token after the first, per run, by the caller's tier.",
                "s",
                quantiles("chatmesh_orchestrator_time_per_output_token_seconds", "tier"),
            ),
            Panel(
                "TTFT at the edge",
                "From the HTTP request to the first text delta relayed to the client, by API.",
                "s",
                quantiles("chatmesh_edge_time_to_first_delta_seconds", "kind"),
            ),
            Panel(
                "Open answer streams",
                "SSE responses open on the edges, and runs generating on the orchestrators.",
                "short",
                (
                    Target(f"sum by (kind) (chatmesh_edge_open_streams{{{NS}}})", "SSE {{kind}}"),
                    Target(f"sum(chatmesh_orchestrator_active_runs{{{NS}}})", "runs generating"),
                ),
            ),
            Panel(
                "Runs ended by status",
                "Runs ended per second, by how they ended.",
                "ops",
                (rate_by("chatmesh_orchestrator_runs_total", "status"),),
                stacked=True,
            ),
            Panel(
                "Event loop lag by pod",
                "How late each Python service's event loop runs what is ready (edge, orchestrator, "
                "router, engine): past ~0.1 s the pod's one thread is full and new calls wait.",
                "s",
                quantiles("chatmesh_event_loop_lag_seconds", "pod"),
            ),
            Panel(
                "Stream interval by orchestrator pod",
                "How long a stream's deltas gather before they leave as one event: 0 while the replica "
                "keeps up; about twice its loop's lag once it runs late, up to --stream-interval-max-ms "
                "(answers arrive in fewer, fuller pieces). Held at the bound: the replicas are short of CPU.",
                "s",
                (
                    Target(
                        f"max by (pod) (chatmesh_orchestrator_stream_interval_seconds{{{NS}}})",
                        "{{pod}}",
                    ),
                ),
            ),
            Panel(
                "Full garbage-collector passes by pod",
                "How long each full pass of the garbage collector (generation 2, over every tracked "
                "object) held the pod's one thread: when it rises with the loop's lag, the heap is the cause.",
                "s",
                quantiles("chatmesh_event_loop_gc_pause_seconds", "pod", f'{NS}, generation="2"'),
            ),
        ],
    )


def router() -> Dashboard:
    hits = "chatmesh_router_{}_total{{" + NS + "}}"
    return Dashboard(
        "chatmesh-router",
        "chatmesh / Router",
        "Where requests go: placements, predicted and actual prefix-cache hits, failovers and sheds.",
        [
            Panel(
                "Placements by policy",
                "Placements per second (first placements and failovers).",
                "ops",
                (rate_by("chatmesh_router_decisions_total", "policy"),),
            ),
            Panel(
                "Prefix hits: predicted vs actual",
                "Share of prompt tokens the index predicted the chosen engine had cached, and the share "
                "it actually served from its cache. A gap means the index is stale or the engine evicted.",
                "percentunit",
                tuple(
                    Target(
                        f"sum(rate({hits.format(kind)}[{RATE}])) / sum(rate({hits.format('prompt_tokens')}[{RATE}]))",
                        legend,
                    )
                    for kind, legend in (
                        ("predicted_cached_tokens", "predicted"),
                        ("cached_tokens", "actual"),
                    )
                ),
            ),
            Panel(
                "Failovers by reason",
                "Requests re-placed on another engine per second, by what went wrong on the first.",
                "ops",
                (rate_by("chatmesh_router_failovers_total", "reason"),),
                stacked=True,
            ),
            Panel(
                "Sheds by tier",
                "Requests refused with RESOURCE_EXHAUSTED per second because no engine's predicted wait fit "
                "the tier's TTFT objective, or every queue was past the tier's depth; and, late, admitted "
                "requests an engine dropped unstarted when their objective ran out in its queue (the "
                "prediction was wrong).",
                "ops",
                (
                    rate_by("chatmesh_router_shed_requests_total", "tier"),
                    Target(
                        f"sum by (tier) (rate(chatmesh_router_queue_expired_requests_total{{{NS}}}[{RATE}]))",
                        "{{tier}}, late (queue limit)",
                    ),
                ),
                stacked=True,
            ),
            Panel(
                "TTFT at the router",
                "From a request's arrival at the router to its first token leaving it.",
                "s",
                quantiles("chatmesh_router_time_to_first_token_seconds", ""),
            ),
            Panel(
                "Healthy engines (routers' view)",
                "Engines each router sees taking work.",
                "short",
                (Target(f"sum by (pod) (chatmesh_router_engine_healthy{{{NS}}})", "router {{pod}}"),),
            ),
        ],
    )


def engines() -> Dashboard:
    return Dashboard(
        "chatmesh-engines",
        "chatmesh / Engines",
        "Each engine: its queue, KV cache, prefix cache and throughput.",
        [
            Panel(
                "Running requests",
                "Requests holding KV blocks, per engine.",
                "short",
                (Target(f"sum by (pod) (chatmesh_engine_running_requests{{{NS}}})", "{{pod}}"),),
            ),
            Panel(
                "Waiting requests",
                "Requests queued per engine (engine.autoscaling scales on their sum).",
                "short",
                (Target(f"sum by (pod) (chatmesh_engine_waiting_requests{{{NS}}})", "{{pod}}"),),
            ),
            Panel(
                "KV cache usage",
                "KV blocks in use / blocks in the pool, per engine.",
                "percentunit",
                (Target(f"max by (pod) (chatmesh_engine_kv_cache_usage_ratio{{{NS}}})", "{{pod}}"),),
            ),
            Panel(
                "Prefix cache hit rate",
                "Prompt tokens served from the prefix cache / prompt tokens looked up, per engine.",
                "percentunit",
                (
                    Target(
                        f"sum by (pod) (rate(chatmesh_engine_prefix_cache_hit_tokens_total{{{NS}}}[{RATE}])) / "
                        f"sum by (pod) (rate(chatmesh_engine_prefix_cache_queried_tokens_total{{{NS}}}[{RATE}]))",
                        "{{pod}}",
                    ),
                ),
            ),
            Panel(
                "Output tokens per second",
                "Tokens sampled per second, per engine.",
                "short",
                (rate_by("chatmesh_engine_generated_tokens_total", "pod"),),
                stacked=True,
            ),
            Panel(
                "Preemptions",
                "Requests preempted per second (their KV blocks freed; recomputed later).",
                "ops",
                (rate_by("chatmesh_engine_preemptions_total", "pod"),),
            ),
            Panel(
                "Engine TTFT and TPOT",
                "The engines' own latencies (gen_ai_server_*): arrival to first token, and per output token.",
                "s",
                quantiles("gen_ai_server_time_to_first_token_seconds", "")
                + quantiles("gen_ai_server_time_per_output_token_seconds", ""),
            ),
        ],
    )


def store() -> Dashboard:
    db = "db_client_operation_duration_seconds"
    return Dashboard(
        "chatmesh-store",
        "chatmesh / Store (Cassandra)",
        "Cassandra as the orchestrators see it: requests, errors and latency by statement.",
        [
            Panel(
                "Requests by statement",
                "Cassandra requests per second, by prepared statement.",
                "reqps",
                (rate_by(f"{db}_count", "db_operation_name"),),
                stacked=True,
            ),
            Panel(
                "Errors by type",
                "Failed Cassandra requests per second, by the driver's error.",
                "reqps",
                (rate_by(f"{db}_count", "error_type", 'error_type!=""'),),
                stacked=True,
            ),
            Panel(
                "Latency by statement",
                "p50 and p99 of each statement's duration.",
                "s",
                quantiles(db, "db_operation_name"),
            ),
            Panel(
                "Prompt assembly",
                "Reading a chat's history and fitting the prompt to the context window.",
                "s",
                quantiles("chatmesh_orchestrator_prompt_assembly_seconds", ""),
            ),
            Panel(
                "Run ends waiting to be stored",
                "Answers whose end Cassandra did not take within --finish-retry-s, by orchestrator pod: "
                "their replica retries them until they land (alert: ChatmeshRunEndsUnstored).",
                "short",
                (
                    Target(
                        f"max by (pod) (chatmesh_orchestrator_late_run_ends_waiting{{{NS}}})",
                        "{{pod}}",
                    ),
                ),
            ),
        ],
    )


def budgets() -> Dashboard:
    return Dashboard(
        "chatmesh-budgets",
        "chatmesh / Budgets",
        "Token budgets and limits: who is refused and how many tokens runs use.",
        [
            Panel(
                "Budget refusals by tier",
                "Sends refused because the user's token budget or concurrent-run limit was reached.",
                "ops",
                (
                    Target(
                        f"sum by (tier, limit) (rate(chatmesh_orchestrator_budget_rejections_total{{{NS}}}[{RATE}]))",
                        "{{tier}} {{limit}}",
                    ),
                ),
                stacked=True,
            ),
            Panel(
                "Budget usage by tier",
                "Tokens (prompt + answer) that ended runs charged to users' budgets, per second, by tier.",
                "short",
                (rate_by("chatmesh_orchestrator_budget_tokens_total", "tier"),),
                stacked=True,
            ),
            Panel(
                "Tokens per second by type",
                "Prompt (input) and answer (output) tokens of finished runs per second.",
                "short",
                (rate_by("gen_ai_client_token_usage_sum", "gen_ai_token_type"),),
            ),
            Panel(
                "Request-limit refusals",
                "Requests refused by a request limit (size of a field), by field.",
                "ops",
                (rate_by("chatmesh_orchestrator_limit_rejections_total", "field"),),
            ),
        ],
    )


def tools() -> Dashboard:
    calls = "chatmesh_orchestrator_tool_calls_total"
    return Dashboard(
        "chatmesh-tools",
        "chatmesh / Tools",
        "Tools the orchestrators run themselves (docs/tools.md): calls, outcomes, durations.",
        [
            Panel(
                "Tool calls by tool and outcome",
                "Calls per second of each tool, by outcome: ok, error (bad arguments or the tool failed), "
                "timeout (--tool-timeout-s), refused (not allowed for the tier), interrupted.",
                "ops",
                (
                    Target(
                        f"sum by (tool, outcome) (rate({calls}{{{NS}}}[{RATE}]))",
                        "{{tool}} {{outcome}}",
                    ),
                ),
                stacked=True,
            ),
            Panel(
                "Tool duration by tool",
                "p50 and p99 of how long each tool's calls ran, whatever their outcome (refusals aside).",
                "s",
                quantiles("chatmesh_orchestrator_tool_duration_seconds", "tool"),
            ),
            Panel(
                "Interrupted steps by tool",
                "Steps found started without a result after their replica was lost: the adopter answers "
                "the model 'interrupted' and never runs the tool again. Steady values mean replicas die "
                "mid-step.",
                "ops",
                (rate_by(calls, "tool", 'outcome="interrupted"'),),
                stacked=True,
            ),
            Panel(
                "Tool failures by tool",
                "Calls per second that ended in an error or a timeout: results the model reads, never a "
                "failed answer.",
                "ops",
                (
                    Target(
                        f'sum by (tool, outcome) (rate({calls}{{{NS}, outcome=~"error|timeout"}}[{RATE}]))',
                        "{{tool}} {{outcome}}",
                    ),
                ),
                stacked=True,
            ),
        ],
    )


DASHBOARDS = (door, router, engines, store, budgets, tools)


def grafana_json(dashboard: Dashboard) -> dict:
    panels = []
    for index, panel in enumerate(dashboard.panels):
        panels.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": panel.title,
                "description": panel.description,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
                "fieldConfig": {
                    "defaults": {
                        "unit": panel.unit,
                        "custom": {"stacking": {"mode": "normal" if panel.stacked else "none"}},
                    },
                    "overrides": [],
                },
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"refId": chr(ord("A") + i), "expr": t.expr, "legendFormat": t.legend}
                    for i, t in enumerate(panel.targets)
                ],
            }
        )
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["chatmesh"],
        "schemaVersion": 39,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "namespace",
                    "type": "query",
                    "label": "Namespace",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(chatmesh_orchestrator_active_runs, namespace)",
                    "refresh": 2,
                    "multi": True,
                    "includeAll": False,
                },
            ]
        },
        "panels": panels,
    }


def rendered() -> dict[str, str]:
    """File name -> JSON text, for every dashboard."""
    out = {}
    for make in DASHBOARDS:
        dashboard = make()
        out[f"{dashboard.uid}.json"] = json.dumps(grafana_json(dashboard), indent=2) + "\n"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the files differ from this script")
    args = parser.parse_args()
    files = rendered()
    if args.check:
        stale = sorted(
            name
            for name, text in files.items()
            if not (OUT / name).exists() or (OUT / name).read_text() != text
        )
        extra = sorted(p.name for p in OUT.glob("*.json") if p.name not in files)
        if stale or extra:
            print(f"out of date: {stale + extra}; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
