"""The chart's observability for SREs: Grafana dashboards as sidecar ConfigMaps, PrometheusRule alerts with
runbooks in docs/operations/monitoring.md, the engines' KEDA autoscaler, and the OpenTelemetry Collector. CRDs are
not in kubernetes-validate's schemas, so their shape is checked here against what their APIs require;
that every metric they read is real is test_observability_metrics.py's job."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.helm.chart import CHART, NAMESPACE, REQUIRED_SETS, ROOT, HelmError, Rendered, env_of, render
from tests.helm.observability import DASHBOARD_LABEL, alert_rules, dashboards, queries
from tests.helm.promql import parse

FULL = "cm-chatmesh"
OPERATIONS_DOC = ROOT / "docs" / "operations" / "monitoring.md"
DASHBOARD_DIR = CHART / "dashboards"
REQUIRED_ALERTS = {
    "ChatmeshTTFTBudgetBurnFast",
    "ChatmeshTTFTBudgetBurnSlow",
    "ChatmeshEngineDown",
    "ChatmeshKVCacheNearFull",
    "ChatmeshShedRate",
    "ChatmeshFailovers",
    "ChatmeshCassandraErrors",
    "ChatmeshRunEndsUnstored",
    "ChatmeshEventLoopSaturated",
}


@pytest.fixture(scope="module")
def full() -> Rendered:
    return render(("values-full.yaml",), ())


@pytest.fixture(scope="module")
def gpu() -> Rendered:
    return render(("values-gpu.yaml",), ())


def test_everything_is_off_by_default_and_engines_keep_their_replica_count():
    chart = render()
    assert not chart.of_kind("PrometheusRule") and not chart.of_kind("ScaledObject")
    assert not dashboards(chart)
    assert not [o for o in chart.objects if "otel-collector" in o["metadata"]["name"]]
    assert chart.get("StatefulSet", f"{FULL}-engine")["spec"]["replicas"] == 2
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env_of(chart.container("router", "router"))


# -- dashboards -----------------------------------------------------------------------------------


def test_dashboards_are_labelled_configmaps_of_the_generated_grafana_json(full):
    # The JSON files are what the generator writes (not edited by hand), and the chart ships them as they are.
    script = ROOT / "scripts" / "grafana_dashboards.py"
    check = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stderr
    files = [json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))]
    assert dashboards(full) == {d["uid"]: d for d in files}
    assert set(dashboards(full)) == {
        f"chatmesh-{d}" for d in ("door", "router", "engines", "store", "budgets", "tools")
    }
    for config_map in full.of_kind("ConfigMap"):
        if DASHBOARD_LABEL in config_map["metadata"]["labels"]:
            assert config_map["metadata"]["labels"][DASHBOARD_LABEL] == "1"
            assert config_map["metadata"]["annotations"] == {"grafana_folder": "chatmesh"}
            assert len(json.dumps(config_map)) < 256 * 1024  # far below a ConfigMap's 1 MiB


def test_dashboard_panels_are_laid_out_and_read_the_namespace_variable(full):
    for uid, dashboard in dashboards(full).items():
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        assert variables == {"datasource", "namespace"}, uid
        cells = set()
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["description"] and panel["fieldConfig"]["defaults"]["unit"]
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24
            cell = (pos["x"], pos["y"])
            assert cell not in cells, f"{uid}: panels overlap at {cell}"
            cells.add(cell)
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(set(ref_ids)) == len(ref_ids) >= 1
            for target in panel["targets"]:
                for name, matchers in parse(target["expr"]).selectors.items():
                    assert any(m.label == "namespace" and m.value == "$namespace" for m in matchers), (
                        f"{uid} / {panel['title']}: {name} is not filtered by $namespace"
                    )


# -- alerts ---------------------------------------------------------------------------------------


def _doc_anchors() -> set[str]:
    """GitHub's anchors of docs/operations/monitoring.md's headings."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", OPERATIONS_DOC.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_alert_has_a_severity_a_duration_and_a_runbook_section_that_exists(full):
    [rule_object] = full.of_kind("PrometheusRule")
    assert rule_object["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = alert_rules(full)
    assert {r["alert"] for r in rules} >= REQUIRED_ALERTS
    anchors = _doc_anchors()
    base = "https://github.com/chatmesh/chatmesh/blob/main/docs/operations/monitoring.md#"
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"\d+[mh]", rule["for"])
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        runbook = rule["annotations"]["runbook_url"]
        assert runbook.startswith(base) and runbook[len(base) :] in anchors, (rule["alert"], runbook)


def test_alerts_select_the_release_namespace_and_its_own_scrape_jobs(full):
    jobs = {m["metadata"]["name"] for m in full.of_kind("ServiceMonitor")}  # job = the Service's name
    # An engine rule reads every engine pool's job (the first pool's, and extraModels'), none other.
    engine_jobs = {j for j in jobs if j.startswith(f"{FULL}-engine")}
    for rule in alert_rules(full):
        for name, matchers in parse(rule["expr"]).selectors.items():
            labels = {m.label: m for m in matchers}
            assert labels["namespace"].op == "=" and labels["namespace"].value == NAMESPACE, rule["alert"]
            job = labels.get("job")
            if job is not None and job.op == "=":
                assert job.value in jobs, (rule["alert"], name, job.value)
            elif job is not None:
                assert {j for j in jobs if re.fullmatch(job.value, j)} in (jobs, engine_jobs), rule["alert"]


def test_ttft_burn_rate_alerts_pair_a_long_and_a_short_window_at_the_objective_budget(full):
    # values-full: 99.5 % of sends within 1 s, so an error budget of 0.5 %.
    rules = {r["alert"]: r for r in alert_rules(full)}
    for alert, windows, factor in (
        ("ChatmeshTTFTBudgetBurnFast", ("1h", "5m"), 14.4),
        ("ChatmeshTTFTBudgetBurnSlow", ("6h", "30m"), 6),
    ):
        expr = rules[alert]["expr"]
        conditions = expr.split("\nand\n")
        assert len(conditions) == 2, alert
        for condition, window in zip(conditions, windows, strict=True):
            assert set(re.findall(r"\[(\w+)\]", condition)) == {window}
            assert float(condition.rsplit(">", 1)[1]) == pytest.approx(factor * 0.005)
            matchers = parse(condition).selectors["chatmesh_orchestrator_time_to_first_token_seconds_bucket"]
            assert ("le", "1.0") in {(m.label, m.value) for m in matchers}


# -- autoscaling ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "kind", "api"),
    [("full", "LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1"), ("gpu", "StatefulSet", "apps/v1")],
)
def test_keda_scales_the_engine_workload_on_queue_depth_and_kv_usage(scenario, kind, api, full, gpu):
    chart = {"full": full, "gpu": gpu}[scenario]
    [scaled] = chart.of_kind("ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": api, "kind": kind, "name": f"{FULL}-engine"}
    # KEDA's HPA owns the count: the workload names none, and the chart makes no HPA of its own for it.
    assert "replicas" not in chart.get(kind, f"{FULL}-engine")["spec"]
    assert f"{FULL}-engine" not in {
        h["spec"]["scaleTargetRef"]["name"] for h in chart.of_kind("HorizontalPodAutoscaler")
    }
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] == 600
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"waiting-requests", "kv-cache-usage"}
    values = yaml.safe_load((ROOT / "tests" / "helm" / f"values-{scenario}.yaml").read_text())
    autoscaling = values["engine"]["autoscaling"]
    expected = {
        "waiting-requests": ("AverageValue", "chatmesh_engine_waiting_requests", "waitingRequestsPerEngine"),
        "kv-cache-usage": ("Value", "chatmesh_engine_kv_cache_usage_ratio", "kvCacheUsageRatio"),
    }
    for name, (metric_type, metric, threshold_key) in expected.items():
        trigger = triggers[name]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == metric_type
        metadata = trigger["metadata"]
        assert metadata["serverAddress"] == autoscaling["prometheusAddress"]
        # KEDA reads thresholds as strings.
        assert isinstance(metadata["threshold"], str)
        assert float(metadata["threshold"]) == autoscaling[threshold_key]
        matchers = {(m.label, m.op, m.value) for m in parse(metadata["query"]).selectors[metric]}
        assert matchers == {("namespace", "=", NAMESPACE), ("job", "=", f"{FULL}-engine")}


def test_engine_autoscaling_needs_keda_values_that_make_sense():
    with pytest.raises(HelmError, match="kvCacheUsageRatio"):
        render(
            sets=(*REQUIRED_SETS, "engine.autoscaling.enabled=true", "engine.autoscaling.kvCacheUsageRatio=2")
        )


# -- OpenTelemetry Collector ----------------------------------------------------------------------


def _collector_config(chart: Rendered) -> dict:
    return yaml.safe_load(chart.get("ConfigMap", f"{FULL}-otel-collector")["data"]["config.yaml"])


def test_collector_config_receives_otlp_and_exports_through_every_configured_exporter(full):
    config = _collector_config(full)
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert list(config["exporters"]) == ["otlp/tempo"]
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    assert traces["exporters"] == ["otlp/tempo"]
    # The memory limiter goes first in the pipeline, as the collector's docs require.
    assert traces["processors"][0] == "memory_limiter" and set(traces["processors"]) <= set(
        config["processors"]
    )
    # Not deployed here: the services export to the collector values-full names.
    assert not [d for d in full.of_kind("Deployment") if d["metadata"]["name"] == f"{FULL}-otel-collector"]
    assert env_of(full.container("router", "router"))["OTEL_EXPORTER_OTLP_ENDPOINT"] == (
        "http://otel-collector.observability:4317"
    )


def test_a_deployed_collector_is_where_the_services_and_envoy_send_spans(gpu):
    address = f"{FULL}-otel-collector.{NAMESPACE}.svc.cluster.local"
    for service in ("edge", "orchestrator", "router", "engine"):
        assert (
            env_of(gpu.container(service, service))["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{address}:4317"
        )
    envoy = json.loads(gpu.get("ConfigMap", f"{FULL}-envoy")["data"]["settings.json"])
    assert envoy["otlp"] == [address, 4317]
    service = gpu.get("Service", f"{FULL}-otel-collector")
    pod = gpu.get("Deployment", f"{FULL}-otel-collector")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["port"]: ports[p["targetPort"]] for p in service["spec"]["ports"]} == {4317: 4317, 4318: 4318}
    # It runs the rendered config, and restarts when it changes.
    [volume] = pod["spec"]["volumes"]
    assert volume["configMap"]["name"] == f"{FULL}-otel-collector"
    mount = container["volumeMounts"][0]
    assert f"--config={mount['mountPath']}/config.yaml" in container["args"]
    assert pod["metadata"]["annotations"]["checksum/config"]
    assert list(_collector_config(gpu)["exporters"]) == ["debug"]


def test_every_chart_query_parses(full):
    found = list(queries(full))
    assert len(found) > 40
    for query in found:
        assert parse(query.expr).metrics, query.where
