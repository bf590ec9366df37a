"""The chart's observability objects as tests read them: every PromQL query a dashboard, an alert or the
engines' autoscaler runs, with where it came from."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from tests.helm.chart import Rendered

# The label Grafana's dashboard sidecar selects by (the chart's default).
DASHBOARD_LABEL = "grafana_dashboard"


@dataclass(frozen=True)
class ChartQuery:
    where: str  # e.g. "dashboard chatmesh-router: Failovers by reason"
    expr: str


def dashboards(chart: Rendered) -> dict[str, dict]:
    """uid -> dashboard JSON, from the ConfigMaps Grafana's sidecar loads."""
    found = {}
    for config_map in chart.of_kind("ConfigMap"):
        if DASHBOARD_LABEL in config_map["metadata"].get("labels", {}):
            for text in config_map["data"].values():
                dashboard = json.loads(text)
                found[dashboard["uid"]] = dashboard
    return found


def alert_rules(chart: Rendered) -> list[dict]:
    return [
        rule
        for rules in chart.of_kind("PrometheusRule")
        for group in rules["spec"]["groups"]
        for rule in group["rules"]
    ]


def queries(chart: Rendered) -> Iterator[ChartQuery]:
    for uid, dashboard in dashboards(chart).items():
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                yield ChartQuery(f"dashboard {uid}: variable {variable['name']}", variable["query"])
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                yield ChartQuery(f"dashboard {uid}: {panel['title']}", target["expr"])
    for rule in alert_rules(chart):
        yield ChartQuery(f"alert {rule['alert']}", rule["expr"])
    for scaled in chart.of_kind("ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            yield ChartQuery(f"ScaledObject trigger {trigger['name']}", trigger["metadata"]["query"])
