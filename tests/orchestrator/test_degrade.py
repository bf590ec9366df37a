"""Overload degrades the free tier to a cheaper model instead of shedding it, through the real mesh:
Cassandra, an orchestrator, a router with ``--degrade``, and two pools of engines. Paid answers stay on
the primary pool; free ones go to the cheaper pool once the primary is past the free tier's threshold,
and are refused only when the cheaper pool is saturated too. The answer, its stored message and the
router's metrics all say which model served it."""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tokenizer import load_tokenizer
from meshkit.launcher import Launcher, free_port
from tests.engine.service_client import wait_until
from tests.fixtures.cassandra import CassandraTestNode
from tests.fixtures.engines import EngineFactory
from tests.fixtures.orchestrator import ChatClient, Mesh, collect, events
from tests.fixtures.router import router_spec, wait_for_engines

MAX_RUNNING, MAX_WAITING = 2, 4  # per engine; the free tier's safe depth is 2 queued
SLOW = 20  # tokens/s per stream: a long answer outlasts the test
LONG = 2000


@pytest.fixture(scope="module")
def models() -> tuple[str, str]:
    primary = load_tokenizer().model_name
    return primary, f"{primary}-lite"


@dataclass(frozen=True)
class TwoPools:
    mesh: Mesh
    router_metrics_port: int

    def degraded(self, primary: str, lite: str) -> float:
        """The router's count of requests degraded from ``primary`` to ``lite``."""
        url = f"http://127.0.0.1:{self.router_metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        sample = f'chatmesh_router_degraded_requests_total{{model="{primary}",served_model="{lite}"}}'
        return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample)), 0.0)


@pytest.fixture(scope="module")
def two_pools(
    mesh_launcher: Launcher,
    cassandra_node: CassandraTestNode,
    start_engines: EngineFactory,
    models: tuple[str, str],
) -> TwoPools:
    """One primary engine, one engine of the cheaper pool (the same weights served under another name),
    a router that degrades the primary model's free requests to the cheaper one, and an orchestrator."""
    primary, lite = models
    limits = {
        "null_tokens_per_s": SLOW,
        "max_running_requests": MAX_RUNNING,
        "max_waiting_requests": MAX_WAITING,
    }
    engines = [
        *start_engines(1, "null", **limits),
        *start_engines(1, "null", served_model_name=lite, **limits),
    ]
    port, metrics_port = free_port(), free_port()
    degrade = {"degrade": f"{primary}={lite}", "free_queue_fraction": 0.5, "metrics_port": metrics_port}
    mesh_launcher.start(router_spec("router-degrade", port, engines, **degrade))
    wait_for_engines(f"127.0.0.1:{port}", len(engines))
    mesh = Mesh(mesh_launcher, cassandra_node, engines, f"127.0.0.1:{port}")
    mesh.start_orchestrator()
    return TwoPools(mesh, metrics_port)


@pytest.fixture
async def runs(
    two_pools: TwoPools, connect: Callable[..., ChatClient]
) -> AsyncIterator[list[tuple[ChatClient, str]]]:
    """The runs a test leaves generating: all cancelled at the end (runs outlive their streams)."""
    started: list[tuple[ChatClient, str]] = []
    yield started
    for client, run_id in started:
        await client.call("CancelRun", chat_pb2.CancelRunRequest(run_id=run_id))


async def start_answer(
    mesh: Mesh, connect: Callable[..., ChatClient], runs: list, tier: str, running: bool = False
) -> chat_pb2.RunStarted:
    """A new user of ``tier`` asks for a long answer; returns the run's `started` and leaves it
    generating. ``running``: wait for its first text, so that the router no longer counts it as queued."""
    user = connect(mesh.orchestrator.address)
    client = user.as_user(user.user, tier)  # the tier is a claim of the caller's token
    chat = await client.create_chat("overload")
    call = client.send(
        chat.chat_id, "Tell me a long story.", options=chat_pb2.GenerationOptions(max_tokens=LONG)
    )
    started = None
    async for event in events(call):
        if started is None:
            started = event.started
            runs.append((client, started.run_id))
        if not running or event.WhichOneof("kind") == "delta":
            call.cancel()
            return started
    raise AssertionError("the stream ended before the answer was under way")


async def test_overload_degrades_free_answers_keeps_paid_ones_on_the_primary_and_sheds_only_when_both_are_full(
    two_pools: Mesh, connect, runs, models
):
    primary, lite = models
    mesh = two_pools.mesh
    # Paid work fills the primary pool to the free tier's threshold: running slots, then half the queue.
    for i in range(MAX_RUNNING + MAX_WAITING // 2):
        started = await start_answer(mesh, connect, runs, "pro", running=i < MAX_RUNNING)
        assert (started.model, started.degraded) == (primary, False)
    # A free answer now comes from the cheaper model, says so, and is stored under that model's name.
    user = connect(mesh.orchestrator.address)
    client = user.as_user(user.user, "free")
    chat = await client.create_chat("degraded")
    answer = await collect(client.send(chat.chat_id, "Hi", options=chat_pb2.GenerationOptions(max_tokens=4)))
    assert (answer[0].started.model, answer[0].started.degraded) == (lite, True)
    assert answer[-1].WhichOneof("kind") == "done"
    listed = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert [m.model for m in listed.messages if m.role == chat_pb2.ROLE_ASSISTANT] == [lite]
    # Paid answers are never degraded: they still get the primary pool, up to its own bound.
    for _ in range(MAX_WAITING - MAX_WAITING // 2):
        started = await start_answer(mesh, connect, runs, "enterprise")
        assert (started.model, started.degraded) == (primary, False)
    # Every free answer the cheaper pool can hold (running and queued) is taken there, none refused ...
    for i in range(MAX_RUNNING + MAX_WAITING):
        started = await start_answer(mesh, connect, runs, "free", running=i < MAX_RUNNING)
        assert (started.model, started.degraded) == (lite, True)
    # ... and only once it is saturated too is a free answer refused, with a retry delay.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await start_answer(mesh, connect, runs, "free")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await wait_until(
        lambda: _equals(two_pools.degraded(primary, lite), 1 + MAX_RUNNING + MAX_WAITING),
        what="the router's degrade counter",
    )


async def _equals(value: float, expected: float) -> bool:
    return value == expected
