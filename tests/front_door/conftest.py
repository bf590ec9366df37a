"""The scripted front door: real Envoy -> real edge -> ScriptedChatService (the edge reaching it itself).

ScriptedChatService (tests/front_door/scripted_chat_service.py) stands in for the orchestrator where a test
must script what the chat service does (inject a failure, delay a call, see exactly which calls reached
it); these tests do not test the orchestrator. Tests through the real mesh use ``mesh_front_door``
(tests/fixtures/front_door.py) and live in ``test_mesh_*.py``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher
from tests.fixtures.front_door import TEST_RATE_LIMITS, FrontDoor, start_front_door
from tests.front_door.scripted_chat_service import ScriptedChatServer, ScriptedChatService

# Short, so a test can show a stream outliving it.
UNARY_TIMEOUT_S = 2.0
EDGE_IDLE_TIMEOUT_S = 1.0
_users = itertools.count(1)


@dataclass
class ScriptedFrontDoor(FrontDoor):
    scripted: ScriptedChatService
    scripted_port: int


@pytest.fixture(scope="session")
def front_door(
    tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys
) -> Iterator[ScriptedFrontDoor]:
    server = ScriptedChatServer().start()
    run_dir = tmp_path_factory.mktemp("front-door")
    try:
        with Launcher(run_dir, echo=lambda line: None) as launcher:
            door = start_front_door(
                launcher,
                dev_jwt_keys,
                [server.port],
                # Idle connections between Envoy and the edge closed in seconds, not a minute, so a test
                # can see who closes them.
                edge_flags=("--sse-ping-s", "1", "--max-body-bytes", str(64 * 1024)),
                edge_idle_timeout_s=EDGE_IDLE_TIMEOUT_S,
                rate_limits=TEST_RATE_LIMITS,
                unary_timeout_s=UNARY_TIMEOUT_S,
            )
            yield ScriptedFrontDoor(
                door.envoy, door.edge, launcher, scripted=server.service, scripted_port=server.port
            )
    finally:
        server.stop()


@pytest.fixture
def user(request: pytest.FixtureRequest) -> str:
    """A user of one's own per test, so per-user rate limits and chat lists never mix between tests."""
    return f"u{os.getpid()}-{next(_users)}-{request.node.name[:40]}"


@pytest.fixture
def chat_id(client: httpx.Client) -> str:
    """A new chat of the test's ``client`` (each module says which front door its client goes through)."""
    reply = client.post("/v1/chats", json={"title": "test chat"})
    assert reply.status_code == 201, reply.text
    return reply.json()["chat_id"]


@pytest.fixture
def two_replicas() -> Iterator[tuple[ScriptedChatServer, ScriptedChatServer]]:
    """Two ScriptedChatServers, for tests of how Envoy places calls over orchestrator replicas."""
    servers = ScriptedChatServer().start(), ScriptedChatServer().start()
    yield servers
    for server in servers:
        server.stop()
