"""Property-based fuzzing of both doors through the real mesh (Envoy -> edge -> orchestrator -> router ->
null engines, Cassandra): every HTTP route of the edge and every ChatService method, with the hostile
input and the properties of tests/front_door/fuzzing.py. Derandomized with no example database, so a run
in CI tries the same cases every time; bench/bench_fuzz.py is the long, random run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.fixtures.front_door import MeshFrontDoor
from tests.front_door.fuzzing import (
    GrpcCase,
    GrpcDoor,
    HttpCase,
    HttpDoor,
    check_grpc,
    check_http,
    grpc_cases,
    http_cases,
    own_ids,
)

BOUNDED = settings(
    max_examples=400,
    derandomize=True,
    database=None,
    deadline=None,
    # No shrinking: a case takes a round trip through the mesh, and the failing one is reported as drawn.
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def http_door(mesh_front_door: MeshFrontDoor) -> Iterator[HttpDoor]:
    mint = mesh_front_door.envoy.keys.mint
    door = HttpDoor(mesh_front_door.url, mint, own_ids(mesh_front_door.url, mint))
    yield door
    door.client.close()


@pytest.fixture(scope="module")
def grpc_door(mesh_front_door: MeshFrontDoor, http_door: HttpDoor) -> Iterator[GrpcDoor]:
    door = GrpcDoor(mesh_front_door.envoy.grpc_target, http_door)
    yield door
    door.channel.close()


def test_no_http_input_gets_a_5xx_a_leak_a_shapeless_error_or_stores_anything(http_door: HttpDoor):
    @BOUNDED
    @given(case=http_cases(http_door.ids))
    def one(case: HttpCase) -> None:
        outcome = check_http(http_door, case)
        assert not outcome.problems, f"{outcome.label}: {outcome.problems}"

    one()
    assert_mesh_answers_normally(http_door)


def test_no_grpc_request_gets_an_internal_error_or_a_leak(grpc_door: GrpcDoor):
    @BOUNDED
    @given(case=grpc_cases(grpc_door.http.ids))
    def one(case: GrpcCase) -> None:
        outcome = check_grpc(grpc_door, case)
        assert not outcome.problems, f"{outcome.label}: {outcome.problems}"

    one()
    assert_mesh_answers_normally(grpc_door.http)


def assert_mesh_answers_normally(door: HttpDoor) -> None:
    """After the storm: the fuzzer's chat still answers, and so does the OpenAI route."""
    auth = door.authorization("owner")
    with door.client.stream(
        "POST",
        f"/v1/chats/{door.ids.chat}/messages",
        json={"content": "still there?", "options": {"max_tokens": 2}},
        headers=auth,
    ) as reply:
        assert reply.status_code == 200, reply.read()
        assert "event: done" in reply.read().decode()
    completion = door.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=auth,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["finish_reason"] == "length"
