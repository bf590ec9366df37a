"""The front door under test: real Envoy -> real edge -> (Envoy's internal listener) -> ScriptedChatService.

ScriptedChatService (tests/front_door/scripted_chat_service.py) stands in for the orchestrator so the
front door can be proven on its own; these tests do not test the orchestrator.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from chatmesh.dev_jwt import DevKeys
from chatmesh.envoy import DEFAULT_RATE_LIMITS, RouteLimits, TierBucket
from chatmesh.launcher import Launcher, free_port
from tests.fixtures.edge import EdgeHandle, start_edge
from tests.fixtures.envoy import EnvoyHandle, envoy_config_for, start_envoy
from tests.front_door.scripted_chat_service import ScriptedChatServer, ScriptedChatService

# Free-tier buckets small enough to reach 429 in a few requests; other tiers keep the defaults.
TEST_RATE_LIMITS = {
    "api": RouteLimits(
        tiers={**DEFAULT_RATE_LIMITS["api"].tiers, "free": TierBucket(burst=8, refill=1, fill_interval_s=30)}
    ),
    "generate": RouteLimits(
        tiers={
            **DEFAULT_RATE_LIMITS["generate"].tiers,
            "free": TierBucket(burst=2, refill=1, fill_interval_s=30),
        }
    ),
}
# Short, so a test can show a stream outliving it.
UNARY_TIMEOUT_S = 2.0
_users = itertools.count(1)


@dataclass
class FrontDoor:
    envoy: EnvoyHandle
    edge: EdgeHandle
    scripted: ScriptedChatService
    scripted_port: int
    launcher: Launcher

    @property
    def url(self) -> str:
        return self.envoy.url

    def auth(self, user: str, tier: str = "pro") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.envoy.token(user, tier)}"}

    def client(self, user: str, tier: str = "pro", **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.auth(user, tier), timeout=10.0, **kw)

    def access_log(self) -> str:
        return (self.launcher.log_dir / "envoy.log").read_text(errors="replace")


@pytest.fixture(scope="session")
def front_door(tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys) -> Iterator[FrontDoor]:
    server = ScriptedChatServer().start()
    run_dir = tmp_path_factory.mktemp("front-door")
    try:
        with Launcher(run_dir, echo=lambda line: None) as launcher:
            edge_port = free_port()
            config = envoy_config_for(
                dev_jwt_keys,
                edge_port=edge_port,
                orchestrator_ports=[server.port],
                rate_limits=TEST_RATE_LIMITS,
                unary_timeout_s=UNARY_TIMEOUT_S,
            )
            edge = start_edge(
                launcher,
                f"127.0.0.1:{config.internal_port}",
                port=edge_port,
                extra_flags=("--sse-ping-s", "1", "--max-body-bytes", str(64 * 1024)),
            )
            envoy = start_envoy(launcher, config, dev_jwt_keys)
            yield FrontDoor(
                envoy=envoy, edge=edge, scripted=server.service, scripted_port=server.port, launcher=launcher
            )
    finally:
        server.stop()


@pytest.fixture
def user(request: pytest.FixtureRequest) -> str:
    """A user of one's own per test, so per-user rate limits and chat lists never mix between tests."""
    return f"u{os.getpid()}-{next(_users)}-{request.node.name[:40]}"
