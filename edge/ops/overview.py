"""What the operations page shows, computed from the scraped rounds (edge.ops.scrape).

The names read here are the services' own (engine/metrics.py, router/metrics.py, orchestrator/metrics.py);
every number is summed over all targets that export it, so two routers or orchestrator replicas add up.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence

from edge.ops.quantiles import bucket_increases, counter_increase, quantile
from edge.ops.scrape import Round

# Percentiles and rates are over this much history, ending at each round.
WINDOW_S = 60.0
PERCENTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
# The latency charts: what the user waits for, measured at the orchestrator.
LATENCY_HISTOGRAMS = {
    "ttft": "chatmesh_orchestrator_time_to_first_token_seconds",
    "tpot": "chatmesh_orchestrator_time_per_output_token_seconds",
}
# How late each service's event loop runs what is ready (meshkit.event_loop): its saturation.
LOOP_LAG_HISTOGRAM = "chatmesh_event_loop_lag_seconds"
_ENGINE_GAUGES = {
    "healthy": "chatmesh_router_engine_healthy",
    "running": "chatmesh_router_engine_running_requests",
    "waiting": "chatmesh_router_engine_waiting_requests",
    "kv_usage": "chatmesh_router_engine_kv_cache_usage_ratio",
    "inflight": "chatmesh_router_engine_inflight_requests",
}


def total(scraped: Round, name: str) -> float:
    return sum(value for _, _, value in scraped.series(name))


def by_label(scraped: Round, name: str, label: str) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    for _, labels, value in scraped.series(name):
        sums[dict(labels).get(label, "")] += value
    return dict(sums)


def window_start(rounds: Sequence[Round], index: int) -> int:
    """The index of the oldest round at most WINDOW_S before ``rounds[index]``."""
    end = rounds[index].at
    return next(i for i in range(index + 1) if end - rounds[i].at <= WINDOW_S)


def rate(rounds: Sequence[Round], name: str) -> float:
    """Per-second increase of counter ``name`` over the last window (0 until two rounds exist)."""
    last = len(rounds) - 1
    first = window_start(rounds, last)
    if first == last:
        return 0.0
    grown = sum(counter_increase(rounds[i - 1], rounds[i], name) for i in range(first + 1, last + 1))
    return grown / (rounds[last].at - rounds[first].at)


def engines(last: Round) -> list[dict]:
    """One row per engine: the router's view of it (health, queues, KV) and its own prefix hit ratio."""
    rows: dict[str, dict] = {}
    for field, name in _ENGINE_GAUGES.items():
        for _, labels, value in last.series(name):
            rows.setdefault(dict(labels)["engine"], {})[field] = value
    for engine, row in rows.items():
        own = last.scrapes.get(engine)
        row["engine"] = engine
        row["healthy"] = bool(row.get("healthy")) and (own is None or own.up)
        # The engine's own ratio, when it is scraped too (as a target named by its engine id).
        hits = own.samples.get("chatmesh_engine_prefix_cache_hit_ratio", {}) if own else {}
        row["prefix_hit_ratio"] = next(iter(hits.values()), None)
    return sorted(rows.values(), key=lambda row: row["engine"])


def loop_lag_p99(rounds: Sequence[Round], target: str) -> float | None:
    """The p99 of ``target``'s event loop lag over the last window (None: it reports none yet)."""
    last = len(rounds) - 1
    counts: dict[float, float] = defaultdict(float)
    for i in range(window_start(rounds, last) + 1, last + 1):
        for le, count in bucket_increases(rounds[i - 1], rounds[i], LOOP_LAG_HISTOGRAM, target).items():
            counts[le] += count
    return quantile(0.99, sorted(counts.items()))


def router(rounds: Sequence[Round]) -> dict:
    last = rounds[-1]
    prompt = total(last, "chatmesh_router_prompt_tokens_total")
    predicted = total(last, "chatmesh_router_predicted_cached_tokens_total")
    cached = total(last, "chatmesh_router_cached_tokens_total")
    return {
        "decisions": by_label(last, "chatmesh_router_decisions_total", "policy"),
        "decisions_per_s": rate(rounds, "chatmesh_router_decisions_total"),
        "prompt_tokens": prompt,
        "predicted_cached_tokens": predicted,
        "cached_tokens": cached,
        "predicted_hit_ratio": predicted / prompt if prompt else None,
        "actual_hit_ratio": cached / prompt if prompt else None,
        "failovers": by_label(last, "chatmesh_router_failovers_total", "reason"),
        "shed": by_label(last, "chatmesh_router_shed_requests_total", "tier"),
    }


def latency(rounds: Sequence[Round]) -> dict[str, list[dict]]:
    """Per chart, one point per round: the percentiles of the window ending there (None: no requests).
    Each round's increase is computed once; a window adds up the increases of the rounds in it."""
    charts: dict[str, list[dict]] = {}
    for chart, histogram in LATENCY_HISTOGRAMS.items():
        # so_far[i][le]: observations from the first round up to round i.
        so_far: list[dict[float, float]] = [{}]
        for before, after in itertools.pairwise(rounds):
            step = bucket_increases(before, after, histogram)
            so_far.append(
                {le: so_far[-1].get(le, 0.0) + step.get(le, 0.0) for le in so_far[-1].keys() | step}
            )
        points = []
        for index, scraped in enumerate(rounds):
            start = so_far[window_start(rounds, index)]
            buckets = sorted((le, count - start.get(le, 0.0)) for le, count in so_far[index].items())
            point: dict = {"at": scraped.at, "count": buckets[-1][1] if buckets else 0}
            point.update({name: quantile(q, buckets) for name, q in PERCENTILES.items()})
            points.append(point)
        charts[chart] = points
    return charts


def budgets(rounds: Sequence[Round]) -> dict:
    last = rounds[-1]
    return {
        "tokens": by_label(last, "chatmesh_orchestrator_budget_tokens_total", "tier"),
        "rejections": by_label(last, "chatmesh_orchestrator_budget_rejections_total", "tier"),
    }


def tools(last: Round) -> list[dict]:
    """One row per tool the orchestrators run (docs/tools.md): its calls by outcome, and their mean
    duration (None before the first)."""
    rows: dict[str, dict] = {}
    for _, labels, value in last.series("chatmesh_orchestrator_tool_calls_total"):
        named = dict(labels)
        calls = rows.setdefault(named["tool"], {"tool": named["tool"], "calls": defaultdict(float)})["calls"]
        calls[named["outcome"]] += value
    seconds = by_label(last, "chatmesh_orchestrator_tool_duration_seconds_sum", "tool")
    timed = by_label(last, "chatmesh_orchestrator_tool_duration_seconds_count", "tool")
    for tool, row in rows.items():
        row["calls"] = dict(row["calls"])
        row["mean_s"] = seconds[tool] / timed[tool] if timed.get(tool) else None
    return sorted(rows.values(), key=lambda row: row["tool"])


def overview(rounds: Sequence[Round], targets: dict[str, str]) -> dict:
    """The page's whole JSON: ``targets`` are the scraped endpoints by name."""
    if not rounds:
        return {"at": None, "window_s": WINDOW_S, "targets": [], "engines": [], "router": None}
    last = rounds[-1]
    return {
        "at": last.at,
        "window_s": WINDOW_S,
        "targets": [
            {
                "name": name,
                "url": url,
                "up": last.scrapes[name].up,
                "error": last.scrapes[name].error,
                "loop_lag_p99_s": loop_lag_p99(rounds, name),
            }
            for name, url in targets.items()
            if name in last.scrapes
        ],
        "engines": engines(last),
        "router": router(rounds),
        "latency": latency(rounds),
        "budgets": budgets(rounds),
        "tools": tools(last),
    }
