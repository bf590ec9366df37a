"""Another user's chat, message or run, in every state (live, finished, deleted), over every HTTP route
(the chat page's API and the Responses API) and every ChatService method, through the real mesh: always 404 / NOT_FOUND, and the reply is the one a
random id gets, byte for byte once the id itself is masked (no title, no text, no existence signal).
The owner's things are untouched afterwards. A deleted chat's runs are NOT_FOUND to their owner too.

The owner's chats are made once per module: one with an answer still generating (800 tokens at 200
tokens/s, about 4 s per answer; the matrix runs inside that window, and its checks of the live run
come first), one finished, one deleted after its answer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import grpc
import httpx
import pytest

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from tests.fixtures.front_door import MeshFrontDoor
from tests.front_door.helpers import answer, send
from tests.front_door.sse_client import iter_events

SECRET = "zebra-umbrella-42"


@dataclass(frozen=True)
class Owned:
    """One of the owner's chats, the messages of its exchange, and its run."""

    chat_id: str
    question_id: str
    answer_id: str
    run_id: str


@dataclass(frozen=True)
class Victim:
    user: str
    live: Owned
    finished: Owned
    deleted: Owned


def _exchange(client: httpx.Client, title: str, max_tokens: int, wait: bool) -> Owned:
    chat_id = client.post("/v1/chats", json={"title": f"{title} {SECRET}"}).json()["chat_id"]
    body = {"content": f"My secret is {SECRET}.", "options": {"max_tokens": max_tokens}}
    if wait:
        events = send(client, chat_id, **body)
        started = events[0].data
    else:
        # Read the first event and leave: the run goes on generating without a client.
        with answer(client, chat_id, **body) as reply:
            started = next(iter_events(reply)).data
    return Owned(chat_id, started["user_message_id"], started["assistant_message_id"], started["run_id"])


@pytest.fixture(scope="module")
def victim(mesh_front_door: MeshFrontDoor) -> Victim:
    user = f"victim-{uuid.uuid4().hex[:8]}"
    with mesh_front_door.client(user) as client:
        finished = _exchange(client, "finished", 8, wait=True)
        deleted = _exchange(client, "deleted", 8, wait=True)
        assert client.delete(f"/v1/chats/{deleted.chat_id}").status_code == 204
        live = _exchange(client, "live", 800, wait=False)
    return Victim(user, live, finished, deleted)


@pytest.fixture
def stranger() -> str:
    return f"stranger-{uuid.uuid4().hex[:8]}"


def _random(owned: Owned) -> Owned:
    """Ids of the same shape (time UUIDs) that name nothing."""
    return Owned(*(str(uuid.uuid1()) for _ in range(4)))


def _http_calls(own_chat: str, target: Owned) -> list[tuple[str, str, dict | None]]:
    """Every HTTP route that takes a chat, message or run id, aimed at ``target``."""
    chat, run = f"/v1/chats/{target.chat_id}", f"/v1/runs/{target.run_id}"
    response = f"/v1/responses/resp_{uuid.UUID(target.run_id).hex}"
    return [
        ("GET", chat, None),
        ("PATCH", chat, {"title": "mine now"}),
        ("GET", f"{chat}/messages", None),
        ("GET", f"{chat}/branch", None),
        ("GET", f"{chat}/messages/{target.answer_id}/branch", None),
        ("POST", f"{chat}/messages", {"content": "hi"}),
        ("POST", f"{chat}/messages", {"content": "hi", "parent_message_id": target.answer_id}),
        ("POST", f"{chat}/messages/{target.answer_id}/regenerate", {}),
        # The stranger's own chat, with the victim's message in it.
        ("POST", f"/v1/chats/{own_chat}/messages", {"content": "hi", "parent_message_id": target.answer_id}),
        ("POST", f"/v1/chats/{own_chat}/messages/{target.answer_id}/regenerate", {}),
        ("GET", run, None),
        ("GET", f"{run}/events", None),
        ("POST", f"{run}/cancel", None),
        # The Responses API: a stored response is the run, `resp_` + its id in hex.
        ("GET", response, None),
        ("GET", f"{response}?stream=true", None),
        ("POST", "/v1/responses", {"input": "hi", "previous_response_id": response.rpartition("/")[2]}),
        ("POST", f"{response}/cancel", None),
        ("DELETE", response, None),
        ("DELETE", chat, None),
    ]


def _masked(text: str, target: Owned) -> str:
    for value in (target.chat_id, target.question_id, target.answer_id, target.run_id):
        text = text.replace(value, "<id>").replace(uuid.UUID(value).hex, "<id>")
    return text


def _http_reply(client: httpx.Client, method: str, path: str, body: dict | None, target: Owned) -> tuple:
    reply = client.request(method, path, json=body)
    return reply.status_code, _masked(reply.text, target)


@pytest.mark.parametrize("state", ["live", "finished", "deleted"])
def test_another_users_things_over_http_are_404_as_if_they_never_were(
    mesh_front_door: MeshFrontDoor, victim: Victim, stranger: str, state: str
):
    target: Owned = getattr(victim, state)
    nothing = _random(target)
    with mesh_front_door.client(stranger) as client:
        own_chat = client.post("/v1/chats", json={}).json()["chat_id"]
        for (method, path, body), (_, random_path, random_body) in zip(
            _http_calls(own_chat, target), _http_calls(own_chat, nothing), strict=True
        ):
            status, text = _http_reply(client, method, path, body, target)
            expected = _http_reply(client, method, random_path, random_body, nothing)
            assert (status, text) == expected, f"{method} {path}"
            assert status == 404 and SECRET not in text, f"{method} {path}: {text}"
        assert client.get("/v1/chats").json()["chats"] == [client.get(f"/v1/chats/{own_chat}").json()]
        # The stranger's own chat got nothing from the victim's message ids.
        assert client.get(f"/v1/chats/{own_chat}/messages").json()["messages"] == []


def _grpc_calls(target: Owned) -> list[tuple[str, object]]:
    return [
        ("GetChat", chat_pb2.GetChatRequest(chat_id=target.chat_id)),
        ("RenameChat", chat_pb2.RenameChatRequest(chat_id=target.chat_id, title="mine now")),
        ("ListMessages", chat_pb2.ListMessagesRequest(chat_id=target.chat_id)),
        ("GetBranch", chat_pb2.GetBranchRequest(chat_id=target.chat_id)),
        ("GetBranch", chat_pb2.GetBranchRequest(chat_id=target.chat_id, leaf_message_id=target.answer_id)),
        ("SendMessage", chat_pb2.SendMessageRequest(chat_id=target.chat_id, content="hi")),
        (
            "RegenerateMessage",
            chat_pb2.RegenerateMessageRequest(chat_id=target.chat_id, message_id=target.answer_id),
        ),
        ("GetRun", chat_pb2.GetRunRequest(run_id=target.run_id)),
        ("StreamRun", chat_pb2.StreamRunRequest(run_id=target.run_id)),
        ("CancelRun", chat_pb2.CancelRunRequest(run_id=target.run_id)),
        ("DeleteChat", chat_pb2.DeleteChatRequest(chat_id=target.chat_id)),
    ]


def _grpc_reply(stub, method: str, request: object, metadata, target: Owned) -> tuple:
    call = getattr(stub, method)
    with pytest.raises(grpc.RpcError) as failure:
        reply = call(request, metadata=metadata, timeout=10)
        if method in ("SendMessage", "RegenerateMessage", "StreamRun"):
            next(iter(reply))
    error = failure.value
    trailers = {key: value for key, value in (error.trailing_metadata() or ()) if key.endswith("-bin")}
    return error.code(), _masked(error.details() or "", target), trailers.keys()


@pytest.mark.parametrize("state", ["live", "finished", "deleted"])
def test_another_users_things_over_grpc_are_not_found_as_if_they_never_were(
    mesh_front_door: MeshFrontDoor, victim: Victim, stranger: str, state: str
):
    target: Owned = getattr(victim, state)
    nothing = _random(target)
    metadata = mesh_front_door.grpc_auth(stranger)
    with grpc.insecure_channel(mesh_front_door.envoy.grpc_target) as channel:
        stub = chat_pb2_grpc.ChatServiceStub(channel)
        for (method, request), (_, random_request) in zip(
            _grpc_calls(target), _grpc_calls(nothing), strict=True
        ):
            got = _grpc_reply(stub, method, request, metadata, target)
            assert got == _grpc_reply(stub, method, random_request, metadata, nothing), method
            assert got[0] == grpc.StatusCode.NOT_FOUND and SECRET not in got[1], (method, got)


def test_a_deleted_chats_answers_are_gone_for_its_owner_too(mesh_front_door: MeshFrontDoor, victim: Victim):
    deleted, nothing = victim.deleted, _random(victim.deleted)
    with mesh_front_door.client(victim.user) as client:
        for method, path in (
            ("GET", f"/v1/runs/{deleted.run_id}"),
            ("GET", f"/v1/runs/{deleted.run_id}/events"),
            ("POST", f"/v1/runs/{deleted.run_id}/cancel"),
            ("GET", f"/v1/chats/{deleted.chat_id}/messages"),
        ):
            status, text = _http_reply(client, method, path, None, deleted)
            random_path = path.replace(deleted.run_id, nothing.run_id).replace(
                deleted.chat_id, nothing.chat_id
            )
            assert (status, text) == _http_reply(client, method, random_path, None, nothing), path
            assert status == 404 and SECRET not in text


def test_the_owners_things_are_untouched(mesh_front_door: MeshFrontDoor, victim: Victim, stranger: str):
    # Runs last in this module: the strangers' renames, deletes, sends and cancels changed nothing.
    with mesh_front_door.client(victim.user) as client:
        chats = {c["chat_id"]: c["title"] for c in client.get("/v1/chats").json()["chats"]}
        assert chats == {victim.live.chat_id: f"live {SECRET}", victim.finished.chat_id: f"finished {SECRET}"}
        run = client.get(f"/v1/runs/{victim.live.run_id}").json()
        # Still generating, or finished on its own: never cancelled by someone else.
        assert run["status"] in ("in_progress", "completed"), json.dumps(run)
        client.post(f"/v1/runs/{victim.live.run_id}/cancel")

        def stored(owned: Owned) -> list[str]:
            reply = client.get(f"/v1/chats/{owned.chat_id}/messages")
            return [m["message_id"] for m in reply.json()["messages"]]

        # The question and its answer, the live one's once its run stored it as it ended: nothing else.
        assert stored(victim.finished) == [victim.finished.answer_id, victim.finished.question_id]
        live = victim.live
        assert stored(live) in ([live.answer_id, live.question_id], [live.question_id])
