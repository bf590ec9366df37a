"""The chat API end to end through the real mesh: Envoy -> edge -> orchestrator -> router -> null engines
(paced, 200 tokens/s per stream), with Cassandra storing everything. What the scripted front door cannot
prove: the exchange is really stored, a refused request stores nothing, a dropped SSE client leaves the
run going and resumes it by Last-Event-ID, an explicit cancel stops the run and frees the engines, tokens
arrive spread over the answer's time, and a 429 comes from the orchestrator's own RESOURCE_EXHAUSTED as
well as from Envoy's local rate limit, each saying which it is."""

from __future__ import annotations

import itertools
import threading
import uuid

import httpx
import pytest

from chatmesh.identity import CHAT_ID_HEADER, TIER_HEADER, USER_ID_HEADER
from tests.fixtures.front_door import MeshFrontDoor
from tests.fixtures.orchestrator import MESH_TOKENS_PER_S
from tests.front_door.helpers import answer, assert_json_error, send, wait_for
from tests.front_door.sse_client import Event, iter_events

# A well-formed id (a time UUID, as the orchestrator makes them) that names no chat and no message.
UNKNOWN_ID = str(uuid.uuid1())


@pytest.fixture
def client(mesh_front_door: MeshFrontDoor, user: str):
    with mesh_front_door.client(user) as client:
        yield client


def messages(client: httpx.Client, chat_id: str) -> list[dict]:
    """The chat's stored messages, newest first (ListMessages through Envoy, edge and orchestrator)."""
    reply = client.get(f"/v1/chats/{chat_id}/messages")
    assert reply.status_code == 200, reply.text
    return reply.json()["messages"]


def delta_text(events: list[Event]) -> str:
    return "".join(e.data["text"] for e in events if e.event == "delta")


def read_events(client: httpx.Client, chat_id: str, content: str, count: int, **body: object) -> list[Event]:
    """The first ``count`` events of an answer; then the connection is dropped (the browser went away)."""
    seen: list[Event] = []
    with answer(client, chat_id, content, **body) as reply:
        assert reply.status_code == 200, reply.read()
        for event in iter_events(reply):
            seen.append(event)
            if len(seen) == count:
                break
    return seen


def resume(client: httpx.Client, chat_id: str, run_id: str, last_event_id: int) -> list[Event]:
    headers = {"Last-Event-ID": str(last_event_id), CHAT_ID_HEADER: chat_id}
    with client.stream("GET", f"/v1/runs/{run_id}/events", headers=headers) as reply:
        assert reply.status_code == 200, reply.read()
        return list(iter_events(reply))


def run_status(client: httpx.Client, run_id: str) -> dict:
    return client.get(f"/v1/runs/{run_id}").json()


def tokens_in(events: list[Event]) -> int:
    return sum(e.data["token_count"] for e in events if e.event == "delta")


def assert_in_order_once(events: list[Event]) -> None:
    """Each event once, in order: the chat page's streams merge the deltas waiting when they are behind
    (a merged delta is numbered as its last), so sequence numbers only increase."""
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)), seqs


# -- the exchange, stored -----------------------------------------------------------------------------


def test_answer_streams_token_by_token_and_the_exchange_is_stored(client: httpx.Client, chat_id: str):
    tokens = 200  # a second at the engines' pace
    events = send(client, chat_id, "Tell me about streams.", options={"max_tokens": tokens})
    assert_in_order_once(events)
    assert events[0].seq == 1 and tokens_in(events) == tokens
    assert [e.event for e in events][:1] == ["started"] and [e.event for e in events][-2:] == [
        "usage",
        "done",
    ]
    started, usage, done = events[0].data, events[-2].data, events[-1].data
    assert usage["completion_tokens"] == tokens and done["finish_reason"] == "length"

    # Streamed, not buffered: the deltas arrive spread over the answer's generation time, in many
    # separate moments, with no single moment carrying most of them. (The first ones come together: the
    # engine starts while the orchestrator stores the question, and the first delta waits for that.)
    deltas = [e for e in events if e.event == "delta"]
    generation_s = tokens / MESH_TOKENS_PER_S
    assert deltas[-1].at - deltas[0].at > 0.5 * generation_s, (deltas[0].at, deltas[-1].at)
    bursts = [[deltas[0]]]
    for before, after in itertools.pairwise(deltas):
        if after.at - before.at > 0.002:
            bursts.append([])
        bursts[-1].append(after)
    assert len(bursts) >= 10, [len(b) for b in bursts]
    assert max(len(b) for b in bursts) < len(deltas) / 2, [len(b) for b in bursts]

    # Stored in Cassandra: the question, and the answer exactly as streamed, linked to each other.
    stored = messages(client, chat_id)
    assert [m["role"] for m in stored] == ["assistant", "user"]
    reply, question = stored
    assert question["content"] == "Tell me about streams."
    assert question["message_id"] == started["user_message_id"]
    assert reply["message_id"] == started["assistant_message_id"] == done["assistant_message_id"]
    assert reply["parent_id"] == question["message_id"]
    assert reply["content"] == delta_text(events) != ""
    assert reply["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == tokens
    assert run_status(client, started["run_id"])["status"] == "completed"
    # The chat's list entry and usage moved with it.
    assert client.get("/v1/chats").json()["chats"][0]["chat_id"] == chat_id
    assert client.get("/v1/usage").json()["used_tokens"] >= usage["prompt_tokens"] + tokens


# -- a dropped stream is not a cancel; resume by Last-Event-ID -------------------------------------------


def test_dropped_sse_client_leaves_the_run_going_and_last_event_id_resumes_it(
    client: httpx.Client, chat_id: str
):
    tokens = 300  # 1.5 s: still running when the client comes back
    seen = read_events(client, chat_id, "Keep talking.", 8, options={"max_tokens": tokens})
    run_id, last = seen[0].data["run_id"], seen[-1].seq
    # Detached, not cancelled: the run goes on generating without anyone listening.
    wait_for(
        lambda: run_status(client, run_id)["last_seq"] > last + 20,
        what="the detached run to keep producing events",
    )
    assert run_status(client, run_id)["status"] == "in_progress"

    rest = resume(client, chat_id, run_id, last)
    whole = seen + rest
    assert_in_order_once(whole)
    assert tokens_in(whole) == tokens  # no gap, no repeat
    assert rest[-1].event == "done" and rest[-1].data["finish_reason"] == "length"
    assert rest[-2].data["completion_tokens"] == tokens
    assert messages(client, chat_id)[0]["content"] == delta_text(whole)

    # Resuming the finished run from the middle replays the same tail, from storage (its deltas merged).
    middle = whole[len(whole) // 2].seq
    tail, replayed = [e for e in whole if e.seq > middle], resume(client, chat_id, run_id, middle)
    assert delta_text(replayed) == delta_text(tail) and tokens_in(replayed) == tokens_in(tail)
    assert [(e.seq, e.event, e.data) for e in replayed[-2:]] == [(e.seq, e.event, e.data) for e in tail[-2:]]
    # From its last event (or past it), there is nothing more: an empty stream, not an error.
    assert resume(client, chat_id, run_id, whole[-1].seq) == []
    assert resume(client, chat_id, run_id, whole[-1].seq + 7) == []


def test_explicit_cancel_stops_the_run_and_frees_the_engines(
    mesh_front_door: MeshFrontDoor, client: httpx.Client, chat_id: str
):
    events: list[Event] = []
    with answer(client, chat_id, "Go on forever.", options={"max_tokens": 3000}) as reply:
        for event in iter_events(reply):
            events.append(event)
            if event.event == "delta" and sum(e.event == "delta" for e in events) == 5:
                run_id = events[0].data["run_id"]
                threading.Thread(target=client.post, args=(f"/v1/runs/{run_id}/cancel",)).start()
    assert events[-1].event == "done" and events[-1].data["finish_reason"] == "cancelled"
    assert events[-2].data["completion_tokens"] < 3000
    assert run_status(client, run_id)["status"] == "cancelled"
    # The engines stop working on it (the cancel reaches them through the router).
    wait_for(lambda: mesh_front_door.mesh.engine_requests() == 0, what="the engines to drop the request")
    stored = messages(client, chat_id)[0]
    assert stored["finish_reason"] == "cancelled" and stored["content"] == delta_text(events)


# -- refused requests store nothing ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b'{"content": "hi"', 400, "malformed JSON"),
        (b'{"content": "\xff\xfe"}', 400, "not valid UTF-8"),
        (b'{"content": "' + b"x" * (70 * 1024) + b'"}', 413, "limit of 65536 bytes"),
        (b'{"content": "' + b"x" * (40 * 1024) + b'"}', 413, "32768"),
        (b'{"content": "hi", "colour": "red"}', 400, "colour"),
        # Refused by the orchestrator, not the edge: its limits and checks.
        (b'{"content": "hi", "options": {"max_tokens": 100000}}', 400, "max_tokens"),
        (b'{"content": "   "}', 400, "must not be empty"),
        (b'{"content": "hi", "parent_message_id": "no-such-message"}', 400, "not a valid id"),
        (b'{"content": "hi", "parent_message_id": "%s"}' % UNKNOWN_ID.encode(), 404, UNKNOWN_ID),
    ],
    ids=[
        "malformed-json",
        "invalid-utf8",
        "body-too-large",
        "message-too-long",
        "unknown-field",
        "max-tokens-over-limit",
        "blank-content",
        "malformed-parent",
        "unknown-parent",
    ],
)
def test_bad_request_is_a_clear_4xx_and_nothing_is_stored(
    client: httpx.Client, chat_id: str, body: bytes, status: int, says: str
):
    reply = client.post(
        f"/v1/chats/{chat_id}/messages", content=body, headers={"Content-Type": "application/json"}
    )
    assert says in assert_json_error(reply, status)["message"]
    assert messages(client, chat_id) == []
    assert client.get(f"/v1/chats/{chat_id}").json()["active_run_id"] is None
    assert client.get("/v1/usage").json()["used_tokens"] == 0


def test_unknown_and_foreign_chat_ids_are_404_and_nothing_is_stored(
    mesh_front_door: MeshFrontDoor, client: httpx.Client, chat_id: str, user: str
):
    assert_json_error(client.post("/v1/chats/not-a-chat-id/messages", json={"content": "hello?"}), 400)
    assert_json_error(client.post(f"/v1/chats/{UNKNOWN_ID}/messages", json={"content": "hello?"}), 404)
    with mesh_front_door.client(user + "-stranger") as stranger:
        assert_json_error(stranger.post(f"/v1/chats/{chat_id}/messages", json={"content": "mine now"}), 404)
        assert_json_error(stranger.get(f"/v1/chats/{chat_id}/messages"), 404)
        assert stranger.get("/v1/chats").json()["chats"] == []
    assert [c["chat_id"] for c in client.get("/v1/chats").json()["chats"]] == [chat_id]
    assert messages(client, chat_id) == []


# -- identity ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "not.a.jwt"], ids=["no-token", "bad-token"])
def test_requests_without_a_valid_token_are_401(mesh_front_door: MeshFrontDoor, token: str | None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    assert_json_error(httpx.post(f"{mesh_front_door.url}/v1/chats", json={}, headers=headers), 401)


def test_forged_identity_headers_are_ignored_by_the_whole_mesh(
    mesh_front_door: MeshFrontDoor, client: httpx.Client, user: str
):
    victim = user + "-victim"
    forged = {USER_ID_HEADER: victim, TIER_HEADER: "enterprise"}
    chat = client.post("/v1/chats", json={"title": "whose?"}, headers=forged).json()
    # Stored as the token's user: theirs to read, invisible to the named victim.
    assert [c["chat_id"] for c in client.get("/v1/chats", headers=forged).json()["chats"]] == [
        chat["chat_id"]
    ]
    with mesh_front_door.client(victim) as real_victim:
        assert real_victim.get("/v1/chats").json()["chats"] == []
        assert_json_error(real_victim.get(f"/v1/chats/{chat['chat_id']}"), 404)


# -- 429: the orchestrator's limits and Envoy's ----------------------------------------------------------


def test_orchestrator_and_envoy_429s_both_say_when_to_retry(mesh_front_door: MeshFrontDoor, user: str):
    # Free tier here: the orchestrator allows one answer at a time, Envoy two sends per 30 s.
    with mesh_front_door.client(user, "free") as client:
        chat_id = client.post("/v1/chats", json={}).json()["chat_id"]
        with answer(client, chat_id, "A long one.", options={"max_tokens": 3000}) as first:
            started = next(iter_events(first)).data

            busy = client.post(f"/v1/chats/{chat_id}/messages", json={"content": "And another?"})
            error = assert_json_error(busy, 429)
            assert error["type"] != "envoy" and "already being generated" in error["message"]
            assert busy.headers["retry-after"] == "2"  # the orchestrator's RetryInfo, rounded up

            limited = client.post(f"/v1/chats/{chat_id}/messages", json={"content": "Please?"})
            assert assert_json_error(limited, 429)["type"] == "envoy"
            assert limited.headers["retry-after"] == "30"  # Envoy's free-tier refill interval
            client.post(f"/v1/runs/{started['run_id']}/cancel")
        # Neither refused send left anything behind: one question, one (cancelled) answer.
        stored = messages(client, chat_id)
        assert [(m["role"], m["content"]) for m in stored][1:] == [("user", "A long one.")]
        assert stored[0]["finish_reason"] == "cancelled"


# -- search -------------------------------------------------------------------------------------------


def test_search_over_rest_finds_the_callers_message_and_only_theirs(
    client: httpx.Client, chat_id: str, mesh_front_door: MeshFrontDoor
):
    send(client, chat_id, "Where do narwhals live?", options={"max_tokens": 4})
    reply = client.get("/v1/search", params={"q": "Narwhals"})
    assert reply.status_code == 200, reply.text
    [hit] = reply.json()["hits"]
    assert (hit["chat_id"], hit["role"], hit["snippet"]) == (chat_id, "user", "Where do narwhals live?")
    assert reply.json()["next_page_token"] is None
    # Only the caller's chats are searched.
    with mesh_front_door.client(f"{uuid.uuid4().hex[:8]}-stranger") as stranger:
        assert stranger.get("/v1/search", params={"q": "narwhals"}).json()["hits"] == []
    assert_json_error(client.get("/v1/search"), 422)
    assert_json_error(client.get("/v1/search", params={"q": "one two three four five six"}), 400)
