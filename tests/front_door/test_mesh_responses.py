"""OpenAI's Responses API through the real mesh (Envoy -> edge -> orchestrator -> router -> paced null
engines, Cassandra), driven by the official ``openai`` SDK, unmodified: stored responses are runs, so
they are retrieved, resumed and cancelled from any replica."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import openai
import pytest

from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher
from tests.fixtures.front_door import (
    MESH_DOOR_ORCHESTRATOR_FLAGS,
    TEST_RATE_LIMITS,
    FrontDoor,
    MeshFrontDoor,
    start_front_door,
)

QUESTION = "Say something."


@pytest.fixture
def sdk(mesh_front_door: MeshFrontDoor, user: str) -> openai.OpenAI:
    return mesh_front_door.sdk(user)


@contextlib.contextmanager
def door_over_another_replica(
    tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys, mesh_front_door: MeshFrontDoor
) -> Iterator[FrontDoor]:
    """Another front door over another orchestrator replica of the same mesh (same Cassandra, router),
    both stopped when the block ends."""
    with (
        mesh_front_door.mesh.replica(**MESH_DOOR_ORCHESTRATOR_FLAGS) as orchestrator,
        Launcher(tmp_path_factory.mktemp("another-door"), echo=lambda line: None) as launcher,
    ):
        yield start_front_door(
            launcher,
            dev_jwt_keys,
            [orchestrator.port],
            edge_flags=("--sse-ping-s", "1"),
            rate_limits=TEST_RATE_LIMITS,
        )


@pytest.fixture(scope="module")
def second_door(
    tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys, mesh_front_door: MeshFrontDoor
) -> Iterator[FrontDoor]:
    with door_over_another_replica(tmp_path_factory, dev_jwt_keys, mesh_front_door) as door:
        yield door


def wait_until_ended(sdk: openai.OpenAI, response_id: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        response = sdk.responses.retrieve(response_id)
        if response.status != "in_progress" or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def deltas(events: list) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_create_retrieve_and_stream_the_same_answer(sdk: openai.OpenAI):
    response = sdk.responses.create(model="", input=QUESTION, max_output_tokens=12)
    assert response.id.startswith("resp_") and response.object == "response"
    # The null engines always run to max_tokens: OpenAI calls that incomplete.
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.usage.output_tokens == 12 and response.usage.input_tokens > 0
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")

    again = sdk.responses.retrieve(response.id)
    assert (again.id, again.status, again.output_text) == (response.id, "incomplete", response.output_text)
    assert again.output[0].id == message.id and again.usage.output_tokens == 12

    events = list(sdk.responses.create(model="", input=QUESTION, max_output_tokens=12, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e.type for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    # The null engines' text depends only on the prompt: the same question, the same answer.
    assert deltas(events) == events[-4].text == response.output_text
    assert sum(e.type == "response.output_text.delta" for e in events) > 1  # token by token
    final = events[-1].response
    assert final.id != response.id and final.output_text == response.output_text
    assert (
        final.usage.output_tokens == 12 and sdk.responses.retrieve(final.id).output_text == final.output_text
    )


def test_previous_response_id_continues_the_conversation(
    mesh_front_door: MeshFrontDoor, sdk: openai.OpenAI, user: str
):
    first = sdk.responses.create(input="My name is Ada.", max_output_tokens=8)
    second = sdk.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=8
    )
    assert second.previous_response_id == first.id
    # The second prompt holds the first exchange.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # Both turns are one chat, one branch: user, assistant, user, assistant.
    with mesh_front_door.client(user) as client:
        [chat] = client.get("/v1/chats").json()["chats"]
        messages = client.get(f"/v1/chats/{chat['chat_id']}/messages").json()["messages"][::-1]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["parent_id"] for m in messages[1:]] == [m["message_id"] for m in messages[:-1]]
    assert messages[2]["content"] == "What is my name?" and messages[3]["content"] == second.output_text


def test_instructions_replace_the_system_prompt_for_one_response(sdk: openai.OpenAI):
    plain = sdk.responses.create(input=QUESTION, max_output_tokens=2)
    instructions = "Answer in the voice of a ship's captain, in one sentence. " * 20
    instructed = sdk.responses.create(input=QUESTION, instructions=instructions, max_output_tokens=2)
    assert instructed.instructions == instructions
    assert instructed.usage.input_tokens > plain.usage.input_tokens + 150
    # As OpenAI's, instructions do not carry over to the next response of the conversation.
    after = sdk.responses.create(input=QUESTION, previous_response_id=instructed.id, max_output_tokens=2)
    assert after.usage.input_tokens < instructed.usage.input_tokens


def test_background_response_is_retrieved_and_cancelled(sdk: openai.OpenAI):
    # No max_output_tokens: the door's default (800 tokens, 4 s at the engines' pace).
    response = sdk.responses.create(input=QUESTION, background=True)
    assert response.status == "in_progress" and response.background is True
    time.sleep(0.5)
    partial = sdk.responses.retrieve(response.id)
    assert partial.status == "in_progress" and partial.output[0].status == "in_progress"
    cancelled = sdk.responses.cancel(response.id)
    assert cancelled.status == "cancelled" and cancelled.output[0].status == "incomplete"
    assert cancelled.output_text.startswith(partial.output_text)
    assert 0 < len(cancelled.output_text) < len(sdk.responses.create(input=QUESTION).output_text)
    time.sleep(0.5)
    later = sdk.responses.retrieve(response.id)
    assert (later.status, later.output_text) == ("cancelled", cancelled.output_text)
    assert sdk.responses.cancel(response.id).status == "cancelled"  # an ended response stays as it is


def test_a_dropped_stream_resumes_after_its_last_sequence_number(sdk: openai.OpenAI):
    stream = sdk.responses.create(input=QUESTION, max_output_tokens=200, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 12:
            break
    stream.close()  # the connection is gone; the run is not
    response_id = seen[0].response.id
    last = seen[-1].sequence_number
    rest = list(sdk.responses.retrieve(response_id, stream=True, starting_after=last))
    assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
    assert rest[-1].type == "response.incomplete"
    assert deltas(seen) + deltas(rest) == rest[-1].response.output_text
    assert rest[-1].response.usage.output_tokens == 200
    # From the start, the same events as first sent.
    replay = list(sdk.responses.retrieve(response_id, stream=True))
    assert [(e.sequence_number, e.type) for e in replay[:12]] == [(e.sequence_number, e.type) for e in seen]


def test_any_replica_retrieves_and_resumes_a_response(
    mesh_front_door: MeshFrontDoor, second_door: FrontDoor, user: str
):
    here, there = mesh_front_door.sdk(user), second_door.sdk(user)
    response = here.responses.create(input=QUESTION, background=True, max_output_tokens=300)
    # Resumed on the other replica while the first still generates it (it follows the checkpoints).
    rest = list(there.responses.retrieve(response.id, stream=True, starting_after=5))
    assert rest[0].sequence_number == 6 and rest[-1].type == "response.incomplete"
    ended = wait_until_ended(here, response.id)
    assert rest[-1].response.output_text == ended.output_text
    assert there.responses.retrieve(response.id).output_text == ended.output_text
    assert ended.usage.output_tokens == 300


def test_a_response_outlives_the_replica_that_generated_it(
    tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys, mesh_front_door: MeshFrontDoor, user: str
):
    with door_over_another_replica(tmp_path_factory, dev_jwt_keys, mesh_front_door) as door:
        there = door.sdk(user)
        made = wait_until_ended(
            there, there.responses.create(input=QUESTION, background=True, max_output_tokens=40).id
        )
        assert made.status == "incomplete" and made.usage.output_tokens == 40
    # That replica (and its edge and Envoy) are gone; the response is not.
    here = mesh_front_door.sdk(user)
    kept = here.responses.retrieve(made.id)
    assert (kept.status, kept.output_text, kept.usage.output_tokens) == ("incomplete", made.output_text, 40)
    rest = list(here.responses.retrieve(made.id, stream=True, starting_after=3))
    assert rest[0].sequence_number == 4 and deltas(rest) == made.output_text
    later = here.responses.create(input=QUESTION, previous_response_id=made.id, max_output_tokens=2)
    assert later.usage.input_tokens > made.usage.input_tokens


def test_unstored_responses_take_a_conversation_and_are_not_kept(
    mesh_front_door: MeshFrontDoor, sdk: openai.OpenAI, user: str
):
    response = sdk.responses.create(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        store=False,
        max_output_tokens=6,
    )
    assert response.store is False and response.usage.output_tokens == 6 and response.output_text
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)
    with mesh_front_door.client(user) as client:
        assert client.get("/v1/chats").json()["chats"] == []


def test_bad_requests_name_the_parameter(mesh_front_door: MeshFrontDoor, sdk: openai.OpenAI, user: str):
    cases = [
        ({"input": QUESTION, "temperature": 5}, "temperature"),
        ({"input": QUESTION, "max_output_tokens": 100_000}, "max_output_tokens"),
        ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "input"),
        ({"input": QUESTION, "store": False, "background": True}, "background"),
        ({"input": [{"role": "robot", "content": "a"}]}, "input"),
        ({"input": ""}, "input"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(**fields)
        assert refused.value.param == param, (fields, refused.value.body)
        assert refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.APIStatusError) as too_large:
        sdk.responses.create(input=QUESTION, instructions="x" * 33_000)
    assert too_large.value.status_code == 413
    # Those the orchestrator refused (after their conversation was made) left none behind.
    with mesh_front_door.client(user) as client:
        assert client.get("/v1/chats").json()["chats"] == []


def test_garbage_is_a_clear_400(mesh_front_door: MeshFrontDoor, sdk: openai.OpenAI, user: str):
    response = sdk.responses.create(input=QUESTION, max_output_tokens=2)
    with mesh_front_door.client(user) as client:
        for body in (
            b"{not json",
            b"[]",
            b'{"input": 5}',
            b'{"input": []}',
            b'{"input": "hi", "stream": "x"}',
        ):
            reply = client.post("/v1/responses", content=body, headers={"content-type": "application/json"})
            assert reply.status_code == 400, (body, reply.text)
            assert reply.json()["error"]["type"] == "invalid_request_error"
        for query, param in (("starting_after=x", "starting_after"), ("stream=maybe", "stream")):
            reply = client.get(f"/v1/responses/{response.id}?{query}")
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param
        # Nothing refused left a conversation behind.
        assert [c["title"] for c in client.get("/v1/chats").json()["chats"]] == [QUESTION]


def test_unknown_and_other_users_responses_are_not_found(
    mesh_front_door: MeshFrontDoor, sdk: openai.OpenAI, user: str
):
    mine = sdk.responses.create(input=QUESTION, max_output_tokens=2)
    other = mesh_front_door.sdk(f"{user}-other")
    for response_id in (mine.id, "resp_0123456789abcdef0123456789abcdef", "resp_nope", "chatcmpl-1"):
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError):
            other.responses.cancel(response_id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(response_id)
    with pytest.raises(openai.NotFoundError) as unknown:
        other.responses.create(input=QUESTION, previous_response_id=mine.id)
    assert unknown.value.param == "previous_response_id"
    assert sdk.responses.retrieve(mine.id).output_text == mine.output_text  # untouched


def test_delete_removes_the_response_and_its_conversation(
    mesh_front_door: MeshFrontDoor, sdk: openai.OpenAI, user: str
):
    first = sdk.responses.create(input=QUESTION, max_output_tokens=2)
    second = sdk.responses.create(input=QUESTION, previous_response_id=first.id, max_output_tokens=2)
    sdk.responses.delete(second.id)
    for response_id in (first.id, second.id):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(response_id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(input=QUESTION, previous_response_id=first.id)
    with mesh_front_door.client(user) as client:
        assert client.get("/v1/chats").json()["chats"] == []


def test_a_create_retried_with_its_idempotency_key_is_the_same_response(
    mesh_front_door: MeshFrontDoor, sdk: openai.OpenAI, user: str
):
    """A client that lost the answer to a stored create sends it again with the same Idempotency-Key:
    it gets the same response, and the conversation holds the question once (CreateChat and SendMessage
    both carry the key). A continuation works the same way, and a key's deleted conversation is 409."""
    key = {"Idempotency-Key": f"key-{uuid.uuid4().hex}"}
    first = sdk.responses.create(input=QUESTION, max_output_tokens=4, extra_headers=key)
    again = sdk.responses.create(input=QUESTION, max_output_tokens=4, extra_headers=key)
    assert (again.id, again.output_text) == (first.id, first.output_text)
    follow_key = {"Idempotency-Key": f"key-{uuid.uuid4().hex}"}
    follow = [
        sdk.responses.create(
            input="And then?", previous_response_id=first.id, max_output_tokens=4, extra_headers=follow_key
        )
        for _ in range(2)
    ]
    assert follow[0].id == follow[1].id
    with mesh_front_door.client(user) as client:
        chats = client.get("/v1/chats").json()["chats"]
        assert len(chats) == 1
        messages = client.get(f"/v1/chats/{chats[0]['chat_id']}/messages").json()["messages"]
    asked = [m["content"] for m in messages if m["role"] == "user"]
    assert sorted(asked) == sorted([QUESTION, "And then?"])
    with pytest.raises(openai.ConflictError):  # another input under the same key
        sdk.responses.create(input="Something else.", max_output_tokens=4, extra_headers=key)
    sdk.responses.delete(first.id)
    with pytest.raises(openai.ConflictError):
        sdk.responses.create(input=QUESTION, max_output_tokens=4, extra_headers=key)
