"""The operations page's numbers from scraped Prometheus text (edge/ops): percentiles as Prometheus's
histogram_quantile computes them, counters across a restart, engines joined with their own metrics."""

from __future__ import annotations

import pytest

from edge.ops.overview import latency, overview, rate
from edge.ops.quantiles import quantile
from edge.ops.scrape import Round, Scrape, parse

TTFT = "chatmesh_orchestrator_time_to_first_token_seconds"


def histogram(counts: dict[str, int], name: str = TTFT) -> str:
    """Prometheus text of one histogram whose cumulative bucket counts are ``counts`` (le -> count)."""
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{kind="send",le="{le}"}} {count}' for le, count in counts.items()]
    total = max(counts.values())
    lines += [f'{name}_count{{kind="send"}} {total}', f'{name}_sum{{kind="send"}} 1.0']
    return "\n".join(lines) + "\n"


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None  # no observations
    # Past the last finite bound: that bound.
    assert quantile(0.99, [(0.1, 1.0), (float("inf"), 100.0)]) == pytest.approx(0.1)


def test_latency_percentiles_cover_only_the_window_and_survive_a_restart():
    first = Round(0.0, {"orchestrator": Scrape(parse(histogram({"0.1": 100, "1": 100, "+Inf": 100})))})
    # 10 slow requests since: the window's p50 is theirs, not the 100 fast ones before it.
    second = Round(10.0, {"orchestrator": Scrape(parse(histogram({"0.1": 100, "1": 110, "+Inf": 110})))})
    # The orchestrator restarted: its counters start again from 0 (4 fast requests).
    third = Round(20.0, {"orchestrator": Scrape(parse(histogram({"0.1": 4, "1": 4, "+Inf": 4})))})
    points = latency([first, second, third])["ttft"]
    assert points[0]["p50"] is None and points[0]["count"] == 0
    assert 0.1 < points[1]["p50"] <= 1.0 and points[1]["count"] == 10
    assert points[2]["count"] == 14  # 10 slow ones still in the minute, plus 4 after the restart


def test_rates_and_the_engine_rows_join_router_and_engine_metrics():
    router_text = (
        'chatmesh_router_decisions_total{policy="kv_aware"} %d\n'
        'chatmesh_router_engine_healthy{engine="e0"} 1\n'
        'chatmesh_router_engine_healthy{engine="e1"} 1\n'
        'chatmesh_router_engine_running_requests{engine="e0"} 3\n'
        'chatmesh_router_engine_kv_cache_usage_ratio{engine="e0"} 0.25\n'
    )
    engine_text = "chatmesh_engine_prefix_cache_hit_ratio 0.75\n"
    rounds = [
        Round(0.0, {"router": Scrape(parse(router_text % 10)), "e0": Scrape(parse(engine_text))}),
        Round(5.0, {"router": Scrape(parse(router_text % 30)), "e0": Scrape(error="ConnectionRefusedError")}),
    ]
    assert rate(rounds, "chatmesh_router_decisions_total") == pytest.approx(4.0)
    view = overview(rounds, {"router": "http://r/metrics", "e0": "http://e0/metrics"})
    e0, e1 = view["engines"]
    # e0's own endpoint is down: the page says so even though the router still counts it healthy.
    assert (e0["engine"], e0["healthy"], e0["running"], e0["kv_usage"]) == ("e0", False, 3, 0.25)
    assert e0["prefix_hit_ratio"] is None
    assert (e1["engine"], e1["healthy"]) == ("e1", True)
    assert view["router"]["decisions"] == {"kv_aware": 30}
    assert [t["up"] for t in view["targets"]] == [True, False]


def test_each_target_shows_its_own_event_loop_lag_over_the_window():
    lag = "chatmesh_event_loop_lag_seconds"
    quiet = {"0.01": 100, "1": 100, "+Inf": 100}
    rounds = [
        Round(
            0.0,
            {
                "router": Scrape(parse(histogram(quiet, lag))),
                "orchestrator": Scrape(parse(histogram(quiet, lag))),
            },
        ),
        # Since then the orchestrator's loop ran 20 timers between 0.01 and 1 s late; the router's none.
        Round(
            10.0,
            {
                "router": Scrape(parse(histogram({"0.01": 140, "1": 140, "+Inf": 140}, lag))),
                "orchestrator": Scrape(parse(histogram({"0.01": 120, "1": 140, "+Inf": 140}, lag))),
            },
        ),
    ]
    view = overview(rounds, {"router": "http://r/metrics", "orchestrator": "http://o/metrics"})
    lags = {t["name"]: t["loop_lag_p99_s"] for t in view["targets"]}
    assert lags["router"] <= 0.01
    assert 0.5 < lags["orchestrator"] <= 1.0
    # One round is no window yet.
    assert overview(rounds[:1], {"router": "http://r/metrics"})["targets"][0]["loop_lag_p99_s"] is None


def test_the_tools_rows_count_calls_by_outcome_and_their_mean_duration():
    orchestrator_text = (
        'chatmesh_orchestrator_tool_calls_total{tool="calculator",outcome="ok"} 3\n'
        'chatmesh_orchestrator_tool_calls_total{tool="calculator",outcome="error"} 1\n'
        'chatmesh_orchestrator_tool_calls_total{tool="clock",outcome="interrupted"} 1\n'
        'chatmesh_orchestrator_tool_duration_seconds_sum{tool="calculator"} 0.008\n'
        'chatmesh_orchestrator_tool_duration_seconds_count{tool="calculator"} 4\n'
    )
    # Two replicas add up.
    scrapes = {name: Scrape(parse(orchestrator_text)) for name in ("o1", "o2")}
    view = overview([Round(0.0, scrapes)], {"o1": "http://o1/metrics", "o2": "http://o2/metrics"})
    calculator, clock = view["tools"]
    assert calculator == {
        "tool": "calculator",
        "calls": {"ok": 6, "error": 2},
        "mean_s": pytest.approx(0.002),
    }
    assert clock == {"tool": "clock", "calls": {"interrupted": 2}, "mean_s": None}
