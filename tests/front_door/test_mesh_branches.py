"""A branch from its leaf, paged by cursor, end to end over REST and gRPC through Envoy: edge and
orchestrator over a real Cassandra, with a regenerated answer making a second branch. Each message comes
with its versions, and a version's newest branch opens from it (newest_leaf). Unknown chats and leaves
are 404 / NOT_FOUND; a page token is good only for its own chat and leaf."""

from __future__ import annotations

import uuid

import grpc
import httpx
import pytest

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from tests.fixtures.front_door import MeshFrontDoor
from tests.front_door.helpers import assert_json_error, send
from tests.front_door.sse_client import iter_events


def started(events) -> dict:
    return events[0].data


def regenerate(client: httpx.Client, chat_id: str, answer_id: str) -> dict:
    path = f"/v1/chats/{chat_id}/messages/{answer_id}/regenerate"
    with client.stream("POST", path, json={"options": {"max_tokens": 2}}) as reply:
        assert reply.status_code == 200, reply.read()
        return started(list(iter_events(reply)))


def pages(client: httpx.Client, path: str, size: int) -> list[list[str]]:
    """Every page of a branch as the ids of its messages, leaf first."""
    found, token = [], None
    while True:
        params = {"page_size": size, **({"page_token": token} if token else {})}
        reply = client.get(path, params=params)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        found.append([m["message_id"] for m in body["messages"]])
        token = body["next_page_token"]
        if token is None:
            return found


@pytest.fixture
def tree(mesh_front_door: MeshFrontDoor, user: str) -> dict[str, str]:
    """q1 a1 q2 a2, then a1 regenerated (a1b) and q3 a3 after it: ids by name."""
    options = {"options": {"max_tokens": 2}}
    with mesh_front_door.client(user) as client:
        chat_id = client.post("/v1/chats", json={"title": "branches"}).json()["chat_id"]
        first = started(send(client, chat_id, "q1", **options))
        second = started(send(client, chat_id, "q2", **options))
        again = regenerate(client, chat_id, first["assistant_message_id"])
        third = started(
            send(client, chat_id, "q3", parent_message_id=again["assistant_message_id"], **options)
        )
    return {
        "chat": chat_id,
        "q1": first["user_message_id"],
        "a1": first["assistant_message_id"],
        "q2": second["user_message_id"],
        "a2": second["assistant_message_id"],
        "a1b": again["assistant_message_id"],
        "q3": third["user_message_id"],
        "a3": third["assistant_message_id"],
    }


def test_a_branch_pages_from_its_leaf_over_rest(mesh_front_door: MeshFrontDoor, user: str, tree):
    chat = f"/v1/chats/{tree['chat']}"
    with mesh_front_door.client(user) as client:
        # The chat's newest message is the default leaf: the regenerated branch.
        newest = pages(client, f"{chat}/branch", 2)
        assert newest == [[tree["a3"], tree["q3"]], [tree["a1b"], tree["q1"]]]
        older = pages(client, f"{chat}/messages/{tree['a2']}/branch", 3)
        assert older == [[tree["a2"], tree["q2"], tree["a1"]], [tree["q1"]]]
        whole = client.get(f"{chat}/messages/{tree['a2']}/branch").json()
        assert [m["content"] for m in whole["messages"]][1:4:2] == ["q2", "q1"]
        assert whole["messages"][0]["parent_id"] == tree["q2"] and whole["next_page_token"] is None

        # Each message with its versions: a1b is the second of a1's versions.
        versions = {m["content"]: m["versions"] for m in client.get(f"{chat}/branch").json()["messages"]}
        assert versions["q1"] == {"count": 1, "number": 1, "previous_id": None, "next_id": None}
        regenerated = client.get(f"{chat}/branch").json()["messages"][2]
        assert regenerated["message_id"] == tree["a1b"]
        assert regenerated["versions"] == {
            "count": 2,
            "number": 2,
            "previous_id": tree["a1"],
            "next_id": None,
        }
        # Switching to a1, its newest branch: from the newest message under it (a2).
        switched = client.get(f"{chat}/messages/{tree['a1']}/branch", params={"newest_leaf": "true"}).json()
        assert [m["message_id"] for m in switched["messages"]] == [
            tree["a2"],
            tree["q2"],
            tree["a1"],
            tree["q1"],
        ]
        assert switched["messages"][2]["versions"]["next_id"] == tree["a1b"]
        assert_json_error(client.get(f"{chat}/branch", params={"newest_leaf": "true"}), 400)
        assert_json_error(
            client.get(f"{chat}/messages/{tree['a1']}/branch", params={"newest_leaf": "yes"}), 400
        )

        assert_json_error(client.get(f"{chat}/messages/{uuid.uuid1()}/branch"), 404)
        assert_json_error(client.get(f"/v1/chats/{uuid.uuid1()}/branch"), 404)
        # A token from one leaf's pages does not page another leaf's branch.
        token = client.get(f"{chat}/branch", params={"page_size": 1}).json()["next_page_token"]
        foreign = client.get(f"{chat}/messages/{tree['a2']}/branch", params={"page_token": token})
        assert "page token" in assert_json_error(foreign, 400)["message"]
        assert_json_error(client.get(f"{chat}/branch", params={"page_size": 201}), 400)


def test_a_branch_pages_from_its_leaf_over_grpc_through_envoy(
    mesh_front_door: MeshFrontDoor, user: str, tree
):
    metadata = mesh_front_door.grpc_auth(user)
    with grpc.insecure_channel(mesh_front_door.envoy.grpc_target) as channel:
        stub = chat_pb2_grpc.ChatServiceStub(channel)
        request = chat_pb2.GetBranchRequest(chat_id=tree["chat"], leaf_message_id=tree["a2"], page_size=3)
        first = stub.GetBranch(request, metadata=metadata, timeout=10)
        assert [m.message_id for m in first.messages] == [tree["a2"], tree["q2"], tree["a1"]]
        request.page_token = first.next_page_token
        rest = stub.GetBranch(request, metadata=metadata, timeout=10)
        assert [m.message_id for m in rest.messages] == [tree["q1"]] and rest.next_page_token == ""
        assert [(v.count, v.number, v.next_id) for v in first.versions] == [
            (1, 1, ""),
            (1, 1, ""),
            (2, 1, tree["a1b"]),
        ]

        newest = chat_pb2.GetBranchRequest(
            chat_id=tree["chat"], leaf_message_id=tree["a1b"], newest_leaf=True
        )
        reply = stub.GetBranch(newest, metadata=metadata, timeout=10)
        assert [m.message_id for m in reply.messages] == [tree["a3"], tree["q3"], tree["a1b"], tree["q1"]]
        with pytest.raises(grpc.RpcError) as failure:
            stub.GetBranch(
                chat_pb2.GetBranchRequest(chat_id=tree["chat"], newest_leaf=True),
                metadata=metadata,
                timeout=10,
            )
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        unknown = chat_pb2.GetBranchRequest(chat_id=tree["chat"], leaf_message_id=str(uuid.uuid1()))
        with pytest.raises(grpc.RpcError) as failure:
            stub.GetBranch(unknown, metadata=metadata, timeout=10)
        assert failure.value.code() == grpc.StatusCode.NOT_FOUND
