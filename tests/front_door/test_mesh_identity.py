"""Identity cannot be forged behind Envoy: the edge and the orchestrator each verify the caller's token
themselves (chatmesh/identity.py), so a process that reaches them directly (in `make run` any local
process, in Kubernetes any pod a NetworkPolicy does not stop) gets 401 / UNAUTHENTICATED for identity
headers or a token Envoy would not accept, and a victim's chat stays out of reach. Calls through Envoy
work as before. The real mesh: Envoy, edge, orchestrator, Cassandra."""

from __future__ import annotations

import grpc
import httpx
import pytest

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.identity import TIER_HEADER, USER_ID_HEADER
from localmesh.dev_jwt import generate_keys
from tests.fixtures.front_door import MeshFrontDoor
from tests.front_door.helpers import assert_json_error

FORGED_HEADERS = {USER_ID_HEADER: "victim", TIER_HEADER: "enterprise"}


@pytest.fixture(scope="module")
def stranger_token(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A well-formed token for the right issuer and audience, signed by a key nobody trusts."""
    return generate_keys(tmp_path_factory.mktemp("stranger")).mint("victim", "enterprise")


@pytest.fixture
def victim_chat(mesh_front_door: MeshFrontDoor, user: str) -> tuple[str, str]:
    """(victim, chat id): a chat made through Envoy by a real user."""
    victim = f"{user}-victim"
    with mesh_front_door.client(victim) as client:
        reply = client.post("/v1/chats", json={"title": "the victim's secret"})
    assert reply.status_code == 201, reply.text
    return victim, reply.json()["chat_id"]


def forgeries(victim: str, stranger_token: str) -> dict[str, dict[str, str]]:
    return {
        "identity headers": {USER_ID_HEADER: victim, TIER_HEADER: "enterprise"},
        "headers and a token of another key": {
            USER_ID_HEADER: victim,
            "authorization": f"Bearer {stranger_token}",
        },
    }


def test_a_direct_call_to_the_edge_with_a_forged_identity_is_401(
    mesh_front_door: MeshFrontDoor, victim_chat: tuple[str, str], stranger_token: str
):
    victim, chat_id = victim_chat
    edge = mesh_front_door.edge.url
    for why, headers in forgeries(victim, stranger_token).items():
        for method, path in (("GET", "/v1/me"), ("GET", "/v1/chats"), ("GET", f"/v1/chats/{chat_id}")):
            reply = httpx.request(method, f"{edge}{path}", headers=headers, timeout=10)
            error = assert_json_error(reply, 401)
            assert error["type"] == "authentication_error", why
            assert "secret" not in reply.text
        reply = httpx.post(f"{edge}/v1/chats", json={"title": "forged"}, headers=headers, timeout=10)
        assert_json_error(reply, 401)
    # Nothing was created in the victim's name.
    with mesh_front_door.client(victim) as client:
        assert [c["chat_id"] for c in client.get("/v1/chats").json()["chats"]] == [chat_id]


def test_a_direct_grpc_call_with_forged_metadata_is_unauthenticated(
    mesh_front_door: MeshFrontDoor, victim_chat: tuple[str, str], stranger_token: str
):
    victim, chat_id = victim_chat
    with grpc.insecure_channel(mesh_front_door.orchestrator.address) as channel:
        stub = chat_pb2_grpc.ChatServiceStub(channel)
        for why, headers in forgeries(victim, stranger_token).items():
            metadata = tuple(headers.items())
            for call, request in (
                (stub.ListChats, chat_pb2.ListChatsRequest()),
                (stub.GetChat, chat_pb2.GetChatRequest(chat_id=chat_id)),
                (stub.CreateChat, chat_pb2.CreateChatRequest(title="forged")),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, metadata=metadata, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
                assert "secret" not in (refused.value.details() or "")
            with pytest.raises(grpc.RpcError) as refused:
                next(
                    iter(stub.StreamRun(chat_pb2.StreamRunRequest(run_id="r"), metadata=metadata, timeout=10))
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
        # The same door with the victim's real token works: the refusal was the proof, not the path.
        proof = mesh_front_door.grpc_auth(victim)
        listed = stub.ListChats(chat_pb2.ListChatsRequest(), metadata=proof, timeout=10).chats
        assert [c.chat_id for c in listed] == [chat_id]


def test_calls_through_envoy_are_proven_by_the_token_alone(
    mesh_front_door: MeshFrontDoor, victim_chat: tuple[str, str], user: str
):
    victim, chat_id = victim_chat
    with mesh_front_door.client(user, "free") as client:
        assert client.get("/v1/me", headers=FORGED_HEADERS).json() == {"user_id": user, "tier": "free"}
        assert_json_error(client.get(f"/v1/chats/{chat_id}", headers=FORGED_HEADERS), 404)
    with mesh_front_door.client(victim) as client:
        assert client.get(f"/v1/chats/{chat_id}").json()["title"] == "the victim's secret"
    with grpc.insecure_channel(mesh_front_door.envoy.grpc_target) as channel:
        stub = chat_pb2_grpc.ChatServiceStub(channel)
        reply = stub.GetChat(
            chat_pb2.GetChatRequest(chat_id=chat_id), metadata=mesh_front_door.grpc_auth(victim), timeout=10
        )
        assert reply.chat.title == "the victim's secret"
