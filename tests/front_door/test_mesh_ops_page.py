"""The operations page (``/ops``) in headless Chromium against a real mesh wired as ``make run`` wires it:
Envoy (exporting its spans over OTLP to localmesh.span_collector) -> edge (scraping every service's
/metrics, reading the span file) -> orchestrator -> router -> two paced null engines, real Cassandra.

A plain user is refused (403, on the API and on the page); an operator watches the numbers move under
load (requests running on the engines, decisions, TTFT/TPOT percentiles, tokens charged by tier) and
looks a run's trace up as a waterfall across Envoy, edge, orchestrator, router and engine. The screenshot
is kept as a test artifact (``.run/test-artifacts/ops-page.png``)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from chatmesh.identity import OPERATOR_ROLE
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher, ServiceSpec, TcpOpen, free_port
from meshkit.telemetry import TRACE_FILE_ENV
from tests.fixtures.browser import artifacts_dir
from tests.fixtures.cassandra import CassandraTestNode
from tests.fixtures.engines import EngineFactory
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.fixtures.orchestrator import Mesh
from tests.fixtures.router import RouterFactory
from tests.front_door.helpers import assert_json_error, wait_for

TOKENS_PER_S = 100


@dataclass
class OpsDoor:
    door: FrontDoor
    mesh: Mesh

    def operator_token(self) -> str:
        return self.door.envoy.keys.mint("ops-tester", "pro", role=OPERATOR_ROLE)


@pytest.fixture(scope="module")
def ops_door(
    tmp_path_factory: pytest.TempPathFactory,
    dev_jwt_keys: DevKeys,
    cassandra_node: CassandraTestNode,
    start_engines: EngineFactory,
    start_router: RouterFactory,
) -> Iterator[OpsDoor]:
    engines = [
        engine
        for _ in range(2)
        for engine in start_engines(1, "null", null_tokens_per_s=TOKENS_PER_S, metrics_port=free_port())
    ]
    router = start_router(engines)
    spans = os.environ[TRACE_FILE_ENV]
    with Launcher(tmp_path_factory.mktemp("ops-page"), echo=lambda line: None) as launcher:
        mesh = Mesh(launcher, cassandra_node, engines, router.address)
        orchestrator = mesh.start_orchestrator()
        otlp = free_port()
        launcher.start(
            ServiceSpec(
                name="span-collector",
                argv=[sys.executable, "-m", "localmesh.span_collector", "--port", str(otlp), "--file", spans],
                ports=(otlp,),
                ready=TcpOpen(otlp),
            )
        )
        targets = {
            **{e.name: f"http://127.0.0.1:{e.metrics_port}/metrics" for e in engines},
            "router": f"http://127.0.0.1:{router.metrics_port}/metrics",
            "orchestrator": orchestrator.metrics_url,
        }
        edge_flags = [
            flag for name, url in targets.items() for flag in ("--ops-metrics-target", f"{name}={url}")
        ]
        edge_flags += ["--ops-trace-file", spans, "--ops-scrape-interval-s", "1"]
        door = start_front_door(
            launcher,
            dev_jwt_keys,
            [orchestrator.port],
            edge_flags=tuple(edge_flags),
            otlp=("127.0.0.1", otlp),
        )
        yield OpsDoor(door, mesh)


def test_a_plain_user_is_refused(ops_door: OpsDoor, user: str, browser_context):
    door = ops_door.door
    with door.client(user) as client:
        error = assert_json_error(client.get("/v1/ops/overview"), 403)
        assert error["type"] == "permission_error" and "operator" in error["message"]
        assert_json_error(client.get("/v1/ops/runs/some-run/trace"), 403)
    # Without a token Envoy refuses before the edge; a role header proves nothing (the role is the token's claim).
    assert httpx.get(f"{door.url}/v1/ops/overview").status_code == 401
    forged = httpx.get(
        f"{door.url}/v1/ops/overview", headers={**door.auth(user), "x-chatmesh-role": OPERATOR_ROLE}
    )
    assert forged.status_code == 403

    page = browser_context.new_page()
    page.goto(f"{door.url}/ops#token={door.envoy.token(user)}")
    page.wait_for_selector("#banner:has-text('operator role')")
    assert page.is_visible("#signin") and page.is_hidden("#dashboard")
    page.close()


def _load(door: FrontDoor, user: str, requests: int, stop: threading.Event) -> list[str]:
    """Streams chat completions, a few at once, until ``requests`` are done; returns their run ids."""
    run_ids: list[str] = []
    failures: list[str] = []
    lock = threading.Lock()
    remaining = iter(range(requests))

    def worker() -> None:
        try:
            stream_answers()
        except Exception as exc:  # the caller asserts there was none
            failures.append(repr(exc))

    def stream_answers() -> None:
        with door.client(user) as client:
            for _ in remaining:
                if stop.is_set():
                    return
                body = {
                    "stream": True,
                    "max_tokens": 80,
                    "messages": [{"role": "user", "content": "Tell me a story."}],
                }
                with client.stream("POST", "/v1/chat/completions", json=body, timeout=60.0) as reply:
                    if reply.status_code != 200:
                        failures.append(f"{reply.status_code}: {reply.read().decode()}")
                        return
                    # The whole answer, to its end; the completion id names the run.
                    chunks = [line for line in reply.iter_lines() if line.startswith("data: {")]
                with lock:
                    run_ids.append(json.loads(chunks[0][6:])["id"].removeprefix("chatcmpl-"))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == [], failures
    return run_ids


def _when(value: dict, condition) -> dict | None:
    return value if condition(value) else None


def numbers(page) -> dict:
    """What the page shows now."""
    return page.evaluate(
        """() => ({
            engines: [...document.querySelectorAll('#engines tbody tr')].map(r => ({
                engine: r.dataset.engine, health: r.cells[1].textContent,
                running: Number(r.querySelector('.running').textContent.replace(/,/g, '')),
                kv: r.querySelector('.kv').textContent, prefix: r.querySelector('.prefix').textContent})),
            decisions: document.querySelector('#router-decisions')?.textContent || '',
            actual: document.querySelector('#router-actual')?.textContent || '',
            ttftPoints: Number(document.querySelector('#chart-ttft').dataset.points || 0),
            tpotPoints: Number(document.querySelector('#chart-tpot').dataset.points || 0),
            proTokens: Number((document.querySelector('#budgets tr[data-tier=pro] .tokens')?.textContent || '0').replace(/,/g, '')),
        })"""
    )


def test_an_operator_watches_the_mesh_under_load_and_follows_a_run(
    ops_door: OpsDoor, user: str, browser_context, tmp_path
):
    door = ops_door.door
    page = browser_context.new_page()
    page.set_default_timeout(20_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(f"{door.url}/ops#token={ops_door.operator_token()}")
        page.wait_for_selector("#engines tbody tr >> nth=1")  # both engines
        before = numbers(page)
        assert [e["health"] for e in before["engines"]] == ["up", "up"], before
        assert all(e["kv"].endswith("%") for e in before["engines"]), before

        # Under load: requests show up running on the engines while the answers stream.
        stop = threading.Event()
        loaded: list[str] = []
        load_failed: list[BaseException] = []

        def load_the_mesh() -> None:
            try:
                loaded.extend(_load(door, user, 24, stop))
            except BaseException as exc:  # the test thread reports it
                load_failed.append(exc)

        load = threading.Thread(target=load_the_mesh)
        load.start()
        try:
            busy = wait_for(
                lambda: _when(numbers(page), lambda now: sum(e["running"] for e in now["engines"]) > 0),
                timeout_s=20,
                what="the page to show requests running on the engines",
            )
        finally:
            load.join(timeout=120)
            stop.set()
        assert load_failed == [] and len(loaded) == 24, (load_failed, loaded)

        # After it: decisions, latency percentiles and the tokens charged to the pro tier all moved.
        after = wait_for(
            lambda: _when(
                numbers(page),
                # Every completion streamed 80 tokens (and had a prompt): at least 24 x 80 are charged.
                lambda now: (
                    now["proTokens"] - before["proTokens"] >= 24 * 80
                    and now["ttftPoints"] > 0
                    and now["tpotPoints"] > 0
                    and now["decisions"] != before["decisions"]
                ),
            ),
            timeout_s=20,
            what="the page to show the load's decisions, latencies and tokens",
        )
        assert "kv_aware" in after["decisions"], after
        # ... and the engines are idle again.
        wait_for(
            lambda: _when(numbers(page), lambda now: sum(e["running"] for e in now["engines"]) == 0),
            timeout_s=20,
            what="the page to show the engines idle after the load",
        )
        assert "prompt tokens" in page.text_content("#router-predicted")
        ttft_p50 = float(page.get_attribute("#chart-ttft", "data-p50"))
        assert 0 < ttft_p50 < 5, ttft_p50

        # One run's trace, looked up by its id: a waterfall across every hop.
        page.fill("#run-id", loaded[-1])
        hops = {"envoy", "edge", "orchestrator", "router", "engine"}

        def traced() -> set[str] | None:
            page.click("#trace-form button")
            page.wait_for_selector("#trace-status:not(:has-text('looking it up'))")
            services = set(
                page.eval_on_selector_all("#waterfall .span", "rows => rows.map(r => r.dataset.service)")
            )
            return services if hops <= services else None

        wait_for(traced, timeout_s=20, what="the run's trace to reach every hop")
        assert busy["engines"] and errors == []
        unknown = page.evaluate(
            "fetch('/v1/ops/runs/no-such-run/trace', {headers: {Authorization: "
            "'Bearer ' + sessionStorage.getItem('chatmesh.opsToken')}}).then(r => r.status)"
        )
        assert unknown == 404
    finally:
        shot = tmp_path / "ops-page.png"
        page.screenshot(path=str(shot), full_page=True)
        shutil.copy(shot, artifacts_dir() / "ops-page.png")
        page.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"
