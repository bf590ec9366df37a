"""When what is behind the door is down, users read what to do, never our internals: through the real
Envoy and edge to a real orchestrator whose router has only a dead engine, one whose router is not
there at all, and an edge whose orchestrator is gone. Each answers 503 with ``Retry-After`` and a plain
message; engine ids, addresses and gRPC's own texts stay in the logs."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher, free_port
from tests.fixtures.edge import start_edge
from tests.fixtures.engines import EngineProcess
from tests.fixtures.envoy import envoy_config_for, start_envoy
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.fixtures.orchestrator import Mesh, orchestrator_spec
from tests.fixtures.router import router_spec
from tests.front_door.fuzzing import leaks
from tests.front_door.helpers import wait_for

DEAD_ENGINE = EngineProcess(name="engine-dead-7", port=free_port(), backend="null")
COMPLETION = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextlib.contextmanager
def door_to(tmp: Path, keys: DevKeys, mesh: Mesh, router: str) -> Iterator[FrontDoor]:
    """Envoy and the edge in front of a new orchestrator over the mesh's Cassandra and ``router``."""
    with Launcher(tmp, echo=lambda line: None) as launcher:
        name, port = f"orchestrator-{uuid.uuid4().hex[:6]}", free_port()
        cql_port = mesh.cassandra.node.config.cql_port
        launcher.start(orchestrator_spec(name, port, free_port(), router, cql_port, replica_id=name))
        yield start_front_door(launcher, keys, [port])


@pytest.fixture(scope="module")
def no_engine_door(
    tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys, mesh: Mesh
) -> Iterator[FrontDoor]:
    with Launcher(tmp_path_factory.mktemp("dead-engine-router"), echo=lambda line: None) as routers:
        router_port = free_port()
        routers.start(router_spec("router-dead-engine", router_port, [DEAD_ENGINE]))
        with door_to(
            tmp_path_factory.mktemp("no-engine"), dev_jwt_keys, mesh, f"127.0.0.1:{router_port}"
        ) as door:
            yield door


@pytest.fixture(scope="module")
def no_router_door(
    tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys, mesh: Mesh
) -> Iterator[FrontDoor]:
    with door_to(
        tmp_path_factory.mktemp("no-router"), dev_jwt_keys, mesh, f"127.0.0.1:{free_port()}"
    ) as door:
        yield door


def assert_plain_503(reply: httpx.Response, *internals: str) -> None:
    assert reply.status_code == 503, reply.text
    assert int(reply.headers["retry-after"]) >= 1
    error = reply.json()["error"]
    assert error["message"] and "retry" in error["message"]
    for internal in internals:
        assert internal not in reply.text
    assert not leaks(reply.text, ""), reply.text


@pytest.mark.parametrize("door_name", ["no_engine_door", "no_router_door"])
def test_a_mesh_that_cannot_answer_says_retry_and_shows_no_internals(
    request: pytest.FixtureRequest, door_name: str
):
    door: FrontDoor = request.getfixturevalue(door_name)
    with door.client(f"u-{uuid.uuid4().hex[:8]}") as client:
        assert_plain_503(
            client.post("/v1/chat/completions", json=COMPLETION), DEAD_ENGINE.name, str(DEAD_ENGINE.port)
        )
        created = client.post("/v1/chats", json={})
        assert created.status_code == 201, created.text
        chat_id = created.json()["chat_id"]
        with client.stream(
            "POST", f"/v1/chats/{chat_id}/messages", json={"content": "hi", "options": {"max_tokens": 2}}
        ) as reply:
            reply.read()
            assert_plain_503(reply, DEAD_ENGINE.name, str(DEAD_ENGINE.port))
        # Refused before it started: nothing of it was stored.
        assert client.get(f"/v1/chats/{chat_id}/messages").json()["messages"] == []


def test_an_orchestrator_that_is_gone_is_a_plain_503(tmp_path: Path, dev_jwt_keys: DevKeys):
    # The edge's one orchestrator replica is not there: its completion links cannot connect.
    gone = free_port()
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        edge_port = free_port()
        config = envoy_config_for(dev_jwt_keys, edge_port=edge_port, orchestrator_ports=[gone])
        start_edge(launcher, f"127.0.0.1:{gone}", port=edge_port)
        envoy = start_envoy(launcher, config, dev_jwt_keys, wait_healthy=False)
        with httpx.Client(
            base_url=envoy.url, headers={"Authorization": f"Bearer {envoy.token('u')}"}
        ) as client:
            wait_for(lambda: client.get("/v1/me").status_code == 200, what="Envoy to route to the edge")
            assert_plain_503(client.get("/v1/chats"), str(gone), "connect")
            assert_plain_503(client.post("/v1/chat/completions", json=COMPLETION), str(gone), "connect")
