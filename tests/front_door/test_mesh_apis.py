"""The other two doors end to end through the real mesh (Envoy -> orchestrator -> router -> paced null
engines, Cassandra): the official ``openai`` SDK, unmodified, against the OpenAI-compatible API, and
gRPC ChatService clients with a JWT and deadlines."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import grpc
import openai
import pytest

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.identity import CHAT_ID_HEADER, USER_ID_HEADER
from tests.fixtures.front_door import MeshFrontDoor
from tests.front_door.helpers import wait_for

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture
def sdk(mesh_front_door: MeshFrontDoor, user: str) -> openai.OpenAI:
    return mesh_front_door.sdk(user)


# -- the openai SDK ---------------------------------------------------------------------------------------


def test_openai_sdk_non_streaming_and_streaming_get_the_same_answer(
    mesh_front_door: MeshFrontDoor, sdk: openai.OpenAI
):
    [model] = [m.id for m in sdk.models.list().data]
    assert sdk.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")
    reply = sdk.chat.completions.create(model=model, messages=PROMPT, max_tokens=12)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == model
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 0
    assert reply.choices[0].message.content

    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=PROMPT,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    # The null engines' text depends only on the prompt's length: the same prompt, the same answer.
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1  # token by token
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens


def test_openai_completions_are_not_stored_as_chats(mesh_front_door: MeshFrontDoor, sdk, user: str):
    sdk.chat.completions.create(model="", messages=PROMPT, max_tokens=2)
    with mesh_front_door.client(user) as client:
        assert client.get("/v1/chats").json()["chats"] == []


def test_openai_sdk_errors_from_the_real_mesh_are_typed(sdk: openai.OpenAI):
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model", messages=PROMPT, max_tokens=2)
    # Past the orchestrator's max_tokens limit: its INVALID_ARGUMENT naming the field, as OpenAI's 400.
    with pytest.raises(openai.BadRequestError, match="max_tokens") as refused:
        sdk.chat.completions.create(model="", messages=PROMPT, max_tokens=100_000)
    assert (refused.value.type, refused.value.param) == ("invalid_request_error", "max_tokens")


def test_a_closed_openai_stream_stops_its_answer_and_frees_the_free_users_slot(
    mesh_front_door: MeshFrontDoor, user: str
):
    # The door's replica lets a free user have one answer at a time; this one would take 10 s.
    body = {"model": "", "messages": PROMPT, "max_tokens": 2000, "stream": True}
    with mesh_front_door.client(user, "free") as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if '"content"' in line:
                    break  # the answer has started; the client goes away
        # Charged what was generated until it left, not prompt + max_tokens (polled slowly: a free
        # user's API bucket holds 8 requests).
        deadline = time.monotonic() + 5
        while (used := client.get("/v1/usage").json()["used_tokens"]) >= 1000:
            assert time.monotonic() < deadline, f"still charged {used} tokens"
            time.sleep(1.0)
        # Its run slot is free again: the next completion is answered, not refused with 429.
        again = client.post("/v1/chat/completions", json={"model": "", "messages": PROMPT, "max_tokens": 4})
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 4


def drop_mid_call(door: MeshFrontDoor, user: str, path: str, body: dict) -> None:
    """Sends a call through Envoy as a free ``user`` and leaves once the engines generate its answer: the
    connection closes before any reply (Envoy resets the call's HTTP/2 stream to the edge)."""
    payload = json.dumps(body).encode()
    address = urlsplit(door.url)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Authorization: {door.auth(user, 'free')['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((address.hostname, address.port), timeout=10) as connection:
        connection.sendall(head.encode() + payload)
        wait_for(lambda: door.mesh.engine_requests() > 0, what="the answer to start generating")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "", "messages": PROMPT, "max_tokens": 2000}),
        (
            "/v1/responses",
            {"model": "", "input": "Say something.", "store": False, "max_output_tokens": 2000},
        ),
    ],
    ids=["chat-completion", "unstored-response"],
)
def test_a_non_streamed_call_its_client_leaves_stops_its_answer_and_frees_the_free_users_slot(
    mesh_front_door: MeshFrontDoor, user: str, path: str, body: dict
):
    mesh_front_door.mesh.wait_until_engines_idle()
    # The door's replica lets a free user have one answer at a time; this one would take 10 s.
    drop_mid_call(mesh_front_door, user, path, body)
    # Left alone, the engines would go on ~10 s.
    wait_for(lambda: mesh_front_door.mesh.engine_requests() == 0, 3.0, "the engines to drop the answer")
    with mesh_front_door.client(user, "free") as client:
        # Charged what was generated until it left, not prompt + max_tokens (polled slowly: a free
        # user's API bucket holds 8 requests).
        deadline = time.monotonic() + 5
        while (used := client.get("/v1/usage").json()["used_tokens"]) >= 1000:
            assert time.monotonic() < deadline, f"still charged {used} tokens"
            time.sleep(1.0)
        # Its run slot is free again: the next call is answered, not refused with 429.
        again = client.post(
            path, json={**body, "max_tokens" if "max_tokens" in body else "max_output_tokens": 4}
        )
        assert again.status_code == 200, again.text


# -- gRPC through Envoy -------------------------------------------------------------------------------------


@pytest.fixture
def stub(mesh_front_door: MeshFrontDoor):
    with grpc.insecure_channel(mesh_front_door.envoy.grpc_target) as channel:
        yield chat_pb2_grpc.ChatServiceStub(channel)


def test_grpc_needs_a_jwt_and_takes_identity_from_it(mesh_front_door: MeshFrontDoor, stub, user: str):
    with pytest.raises(grpc.RpcError) as failure:
        stub.ListChats(chat_pb2.ListChatsRequest(), timeout=5)
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
    auth = mesh_front_door.grpc_auth(user)
    chat = stub.CreateChat(
        chat_pb2.CreateChatRequest(title="grpc"), metadata=(*auth, (USER_ID_HEADER, "victim")), timeout=5
    ).chat
    listed = stub.ListChats(chat_pb2.ListChatsRequest(), metadata=auth, timeout=5).chats
    assert [c.chat_id for c in listed] == [chat.chat_id]


def test_grpc_refusals_of_huge_or_malformed_requests_are_invalid_argument(
    mesh_front_door: MeshFrontDoor, stub, user: str
):
    auth = mesh_front_door.grpc_auth(user)
    # An error quoting a 40 KB id would not fit in a header: Envoy would answer UNAVAILABLE instead.
    with pytest.raises(grpc.RpcError) as huge:
        stub.GetChat(chat_pb2.GetChatRequest(chat_id="x" * 40_000), metadata=auth, timeout=5)
    assert huge.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(huge.value.details()) <= 512
    # Bytes that are no GetChatRequest at all (corrupt wire format; a string field that is not UTF-8).
    with grpc.insecure_channel(mesh_front_door.envoy.grpc_target) as channel:
        get_chat = channel.unary_unary(
            "/chatmesh.chat.v1.ChatService/GetChat", request_serializer=bytes, response_deserializer=bytes
        )
        for garbage in (b"\xff\xff\xff", b"\x0a\x03\xff\xfe\xfd"):
            with pytest.raises(grpc.RpcError) as malformed:
                get_chat(garbage, metadata=auth, timeout=5)
            assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "DecodeError" not in malformed.value.details()


def test_grpc_stream_deadline_is_honoured_and_the_run_goes_on(
    mesh_front_door: MeshFrontDoor, stub, user: str
):
    auth = mesh_front_door.grpc_auth(user)
    chat_id = stub.CreateChat(chat_pb2.CreateChatRequest(), metadata=auth, timeout=5).chat.chat_id
    routed = (*auth, (CHAT_ID_HEADER, chat_id))
    request = chat_pb2.SendMessageRequest(
        chat_id=chat_id, content="Take your time.", options=chat_pb2.GenerationOptions(max_tokens=400)
    )
    seen: list[chat_pb2.RunEvent] = []
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as failure:
        for response in stub.SendMessage(request, metadata=routed, timeout=1.0):
            seen.append(response.event)
    elapsed = time.monotonic() - started
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The orchestrator ended the call just before the client's deadline, saying how to go on.
    assert "resume it with StreamRun" in (failure.value.details() or "")
    assert elapsed < 1.8, elapsed  # the answer takes 2 s; the call ended at its deadline
    assert seen and seen[0].WhichOneof("kind") == "started"

    # A deadline is the client leaving, not a cancel: the run finishes, and StreamRun picks it up.
    run_id = seen[0].started.run_id
    rest = [
        r.event
        for r in stub.StreamRun(
            chat_pb2.StreamRunRequest(run_id=run_id, after_seq=seen[-1].seq), metadata=routed, timeout=30
        )
    ]
    whole = seen + rest
    assert [e.seq for e in whole] == list(range(1, len(whole) + 1))
    assert whole[-1].done.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    stored = stub.ListMessages(chat_pb2.ListMessagesRequest(chat_id=chat_id), metadata=routed, timeout=5)
    assert stored.messages[0].content == "".join(
        e.delta.text for e in whole if e.WhichOneof("kind") == "delta"
    )
