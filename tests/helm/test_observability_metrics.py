"""Dashboards, alerts and the engines' autoscaler cannot rot: every metric name and label their PromQL reads
is one the services really export, scraped from running services.

The mesh is real processes over real sockets (tests/fixtures): two paced null engines with tiny queues,
a router over them, an orchestrator over the session's Cassandra, and the edge in front of it. The test
drives what makes the labelled series exist: answers through the edge (SSE and the OpenAI API) and an
invalid request; at the orchestrator a send over a request limit and one over the concurrent-run limit;
free-tier requests shed at the router while both engines' queues are full; pro requests refused when
they queued past their objective; and a failover (an engine
killed mid-stream). Then it scrapes each
service's /metrics and checks every query of the rendered chart (values-full, and the defaults with
alerts on) against what it scraped: metric names as sample names (``x_bucket``, ``x_total``: what
PromQL selects), label names, and the values of ``=`` and ``=~`` matchers on exported labels (``le="2.0"``
must be a bucket bound as the client spells it).
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.tokenizer import ChatMessage, load_tokenizer
from meshkit.launcher import Launcher, free_port
from tests.fixtures.edge import EdgeHandle, start_edge
from tests.fixtures.identity import session_keys
from tests.fixtures.orchestrator import ChatClient, Mesh, OrchestratorProcess, collect
from tests.helm.chart import REQUIRED_SETS, render
from tests.helm.observability import ChartQuery, queries
from tests.helm.promql import Matcher, parse
from tests.router.router_client import Stream, generate, start_frame

# Labels Prometheus gives every series of a target (the ServiceMonitors' defaults), and series it makes
# itself per target: the services do not export these.
TARGET_LABELS = {"namespace", "job", "pod", "instance", "service", "endpoint", "container"}
PROMETHEUS_SERIES = {"up"}
TOKENS_PER_S = 40
LONG = 2000  # tokens: nothing this long finishes while the test looks


@dataclass
class Scrape:
    """Sample name -> label name -> values seen, over every service's /metrics."""

    series: dict[str, dict[str, set[str]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(set))
    )

    def add(self, exposition: str) -> None:
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                labels = self.series[sample.name]
                for name, value in sample.labels.items():
                    labels[name].add(value)

    def problems(self, query: ChartQuery) -> list[str]:
        parsed = parse(query.expr)
        found = []
        for name, matchers in parsed.selectors.items():
            if name in PROMETHEUS_SERIES:
                found += [f"{name} has no label {m.label}" for m in matchers if m.label not in TARGET_LABELS]
            elif name not in self.series:
                found.append(f"no service exports {name}")
            else:
                found += [p for m in matchers if (p := self._matcher_problem(name, m))]
        labels_read = set(TARGET_LABELS)
        for name in parsed.selectors:
            labels_read |= set(self.series.get(name, {}))
        found += [
            f"groups by {label}, which none of its metrics has" for label in parsed.grouping - labels_read
        ]
        return [f"{query.where}: {problem}" for problem in found]

    def _matcher_problem(self, name: str, matcher: Matcher) -> str | None:
        if matcher.label in TARGET_LABELS:
            return None
        values = self.series[name].get(matcher.label)
        if values is None:
            return f"{name} has no label {matcher.label}"
        if matcher.op == "=" and matcher.value not in values:
            return f"{name}{{{matcher.label}={matcher.value!r}}} never seen (values: {sorted(values)})"
        if matcher.op == "=~" and not any(re.fullmatch(matcher.value, v) for v in values):
            return f"{name}{{{matcher.label}=~{matcher.value!r}}} matches nothing seen ({sorted(values)})"
        return None


@dataclass
class MetricsMesh:
    mesh: Mesh
    engine_launcher: Launcher
    router_address: str
    router_metrics: str
    orchestrator: OrchestratorProcess
    edge: EdgeHandle

    def engine_metrics(self) -> list[str]:
        return [f"http://127.0.0.1:{e.metrics_port}/metrics" for e in self.mesh.engines]


def _scrape(urls: list[str], into: Scrape) -> None:
    for url in urls:
        response = httpx.get(url, timeout=10)
        response.raise_for_status()
        into.add(response.text)


async def _answers_through_the_edge(edge: EdgeHandle) -> None:
    headers = {"Authorization": f"Bearer {session_keys().mint('metrics-user', 'pro')}"}
    async with httpx.AsyncClient(base_url=edge.url, headers=headers, timeout=60) as http:
        created = await http.post("/v1/chats", json={"title": "metrics"})
        created.raise_for_status()
        chat_id = created.json()["chat_id"]
        async with http.stream(
            "POST", f"/v1/chats/{chat_id}/messages", json={"content": "Hello.", "options": {"max_tokens": 8}}
        ) as sse:
            assert sse.status_code == 200
            body = "".join([chunk async for chunk in sse.aiter_text()])
            assert "event: delta" in body
        completion = await http.post(
            "/v1/chat/completions",
            json={
                "model": "",
                "messages": [{"role": "user", "content": "Hi."}],
                "max_tokens": 4,
                "stream": True,
            },
        )
        assert completion.status_code == 200
        bad = await http.post("/v1/chat/completions", json={"messages": "not a list"})
        assert bad.status_code == 400  # the OpenAI error shape, for a body of the wrong type


async def _refusals_at_the_orchestrator(orchestrator: OrchestratorProcess) -> None:
    """A send naming no chat (limit_rejections); then, as the replica runs one answer at a time per free
    user, a second send while one runs (budget_rejections)."""
    client = ChatClient(orchestrator.address, tier="free")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await collect(client.send("", "To no chat."))
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        chat = await client.create_chat()
        first = client.send(
            chat.chat_id, "A long answer, please.", options=chat_pb2.GenerationOptions(max_tokens=200)
        )
        await first.read()  # the run has started
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(client.send(chat.chat_id, "And another."))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
    finally:
        await client.close()


async def _sheds_then_a_failover(stub: router_pb2_grpc.RouterServiceStub, mesh: MetricsMesh) -> list[str]:
    """Fills both engines (one running, one queued each: past the free tier's depth) until a free request
    is shed; scrapes the engines; waits for the queued ones to be refused at their queue limit; then
    kills the engine under a running stream, which fails over."""
    tok = load_tokenizer()
    prompt = tok.encode_chat([ChatMessage("user", "Fill the queues.")])
    streams = [
        Stream.start(stub, start_frame(prompt, max_tokens=LONG, tier=router_pb2.TIER_PRO)) for _ in range(4)
    ]
    try:
        for stream in streams:
            await stream.until("routed")
        deadline = time.monotonic() + 20
        while True:
            try:
                await generate(stub, start_frame(prompt, tier=router_pb2.TIER_FREE))
            except ServiceError as exc:
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    break
                raise
            assert time.monotonic() < deadline, "the router never shed the free tier"
            await asyncio.sleep(0.1)
        async with httpx.AsyncClient(timeout=10) as http:
            engine_pages = [(await http.get(url)).text for url in mesh.engine_metrics()]
        # The two queued behind the running ones wait past the pro tier's objective (1 s): their
        # engines drop them, and the router refuses them late.
        ends = [asyncio.ensure_future(stream.rest()) for stream in streams]
        deadline = time.monotonic() + 20
        while sum(end.done() for end in ends) < 2:
            assert time.monotonic() < deadline, "no queued request reached its queue limit"
            await asyncio.sleep(0.1)
        for end in (end for end in ends if end.done()):
            error = end.exception()
            assert isinstance(error, ServiceError), error
            assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    finally:
        for stream in streams:
            stream.drop()
    await asyncio.sleep(0.5)  # the engines free the cancelled requests' slots
    stream = Stream.start(stub, start_frame(prompt, max_tokens=100, tier=router_pb2.TIER_ENTERPRISE))
    routed = await stream.until("routed")
    await stream.until("tokens")
    victim = next(e for e in mesh.mesh.engines if e.name == routed.routed.engine_id)
    mesh.engine_launcher.signal(victim.name, signal.SIGKILL)
    outcome = await stream.rest()
    assert len(outcome.routed) == 2, "the stream should have failed over to the other engine"
    return engine_pages


@pytest.fixture(scope="module")
def metrics_mesh(
    start_engines, start_router, cassandra_node, mesh_launcher, engine_launcher, tmp_path_factory
):
    engines = [
        e
        for _ in range(2)
        for e in start_engines(
            1,
            "null",
            null_tokens_per_s=TOKENS_PER_S,
            max_running_requests=1,
            max_waiting_requests=2,
            metrics_port=free_port(),
        )
    ]
    router = start_router(engines, free_queue_fraction=0.5)
    mesh = Mesh(mesh_launcher, cassandra_node, engines, router.address)
    # With its own tools on, the orchestrator exports their series from 0 (no step need be driven).
    orchestrator = mesh.start_orchestrator(concurrent_runs_free=1, tools=True)
    with Launcher(tmp_path_factory.mktemp("metrics-edge"), echo=lambda line: None) as launcher:
        edge = start_edge(launcher, orchestrator.address)
        yield MetricsMesh(
            mesh,
            engine_launcher,
            router.address,
            f"http://127.0.0.1:{router.metrics_port}/metrics",
            orchestrator,
            edge,
        )
    mesh.stop_orchestrator(orchestrator)


@pytest.fixture(scope="module")
async def scraped(metrics_mesh: MetricsMesh) -> Scrape:
    # On the session's event loop: asyncio.run here would leave no current loop behind it, and every
    # later sync fixture that opens a grpc.aio channel would fail (or bind a loop that never runs).
    await _answers_through_the_edge(metrics_mesh.edge)
    await _refusals_at_the_orchestrator(metrics_mesh.orchestrator)
    async with grpc.aio.insecure_channel(metrics_mesh.router_address) as channel:
        engine_pages = await _sheds_then_a_failover(router_pb2_grpc.RouterServiceStub(channel), metrics_mesh)
    scrape = Scrape()
    for page in engine_pages:
        scrape.add(page)
    _scrape(
        [metrics_mesh.router_metrics, metrics_mesh.orchestrator.metrics_url, metrics_mesh.edge.metrics_url],
        scrape,
    )
    return scrape


def test_the_drive_made_the_labelled_series_the_chart_reads(scraped: Scrape):
    assert "free" in scraped.series["chatmesh_router_shed_requests_total"]["tier"]
    assert "pro" in scraped.series["chatmesh_router_queue_expired_requests_total"]["tier"]
    assert scraped.series["chatmesh_router_failovers_total"]["reason"]
    rejections = scraped.series["chatmesh_orchestrator_budget_rejections_total"]
    assert "free" in rejections["tier"] and "concurrent_runs" in rejections["limit"]
    assert "400" in scraped.series["chatmesh_edge_http_requests_total"]["status"]
    assert "" in scraped.series["db_client_operation_duration_seconds_count"]["error_type"]
    calls = scraped.series["chatmesh_orchestrator_tool_calls_total"]
    assert "calculator" in calls["tool"] and "interrupted" in calls["outcome"]


def test_every_dashboard_alert_and_scaler_query_reads_what_the_services_export(scraped: Scrape):
    chart_queries = [
        *queries(render(("values-full.yaml",), ())),
        *queries(
            render(sets=(*REQUIRED_SETS, "metrics.alerts.enabled=true", "metrics.dashboards.enabled=true"))
        ),
    ]
    assert len(chart_queries) > 80
    problems = [problem for query in chart_queries for problem in scraped.problems(query)]
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_renamed_metric_a_wrong_label_and_a_bucket_bound_that_does_not_exist(
    scraped: Scrape,
):
    cases = {
        "sum(rate(chatmesh_router_shed_total[5m]))": "no service exports chatmesh_router_shed_total",
        'sum(rate(chatmesh_router_shed_requests_total{tiers="free"}[5m]))': "has no label tiers",
        'rate(chatmesh_orchestrator_time_to_first_token_seconds_bucket{le="2"}[5m])': "never seen",
        "sum by (engine) (chatmesh_engine_waiting_requests)": "groups by engine",
        'chatmesh_edge_http_requests_total{status=~"6.."}': "matches nothing seen",
    }
    for expr, problem in cases.items():
        [found] = scraped.problems(ChartQuery("case", expr))
        assert problem in found, (expr, found)
    assert not scraped.problems(ChartQuery("case", 'up{namespace="x"} == 0'))
