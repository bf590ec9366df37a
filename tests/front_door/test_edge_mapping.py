"""The edge's HTTP <-> ChatService mapping, through the real Envoy and the real edge, against
ScriptedChatService (a real gRPC server with scripted answers; these tests do not test the orchestrator):
REST shapes, SSE framing and resume, cancel, status codes, and refusing bad input before any call."""

from __future__ import annotations

import grpc
import httpx
import pytest

from tests.front_door.conftest import ScriptedFrontDoor
from tests.front_door.helpers import answer, assert_json_error, send, wait_for
from tests.front_door.sse_client import iter_events


@pytest.fixture
def client(front_door: ScriptedFrontDoor, user: str):
    with front_door.client(user) as client:
        yield client


# -- chats CRUD -------------------------------------------------------------------------------------


def test_chat_crud_round_trip(client: httpx.Client):
    created = client.post("/v1/chats", json={"title": "Plans"})
    assert created.status_code == 201
    chat = created.json()
    assert chat["title"] == "Plans" and chat["chat_id"] and chat["create_time"].endswith("Z")

    assert client.get(f"/v1/chats/{chat['chat_id']}").json()["title"] == "Plans"
    renamed = client.patch(f"/v1/chats/{chat['chat_id']}", json={"title": "Holiday plans"})
    assert renamed.status_code == 200 and renamed.json()["title"] == "Holiday plans"

    assert client.delete(f"/v1/chats/{chat['chat_id']}").status_code == 204
    assert_json_error(client.get(f"/v1/chats/{chat['chat_id']}"), 404)


def test_chat_list_is_newest_activity_first_and_paginated(client: httpx.Client):
    ids = [client.post("/v1/chats", json={"title": f"chat {i}"}).json()["chat_id"] for i in range(3)]
    first = client.get("/v1/chats", params={"page_size": 2}).json()
    assert [c["chat_id"] for c in first["chats"]] == [ids[2], ids[1]]
    assert first["next_page_token"]
    second = client.get("/v1/chats", params={"page_size": 2, "page_token": first["next_page_token"]}).json()
    assert [c["chat_id"] for c in second["chats"]] == [ids[0]]
    assert second["next_page_token"] is None


def test_usage_reports_the_callers_budget(client: httpx.Client, chat_id: str):
    send(client, chat_id, "count me !tokens 4 1")
    usage = client.get("/v1/usage").json()
    assert usage["tier"] == "pro" and usage["limit_tokens"] == 1_000_000
    assert usage["used_tokens"] == 5 + 4  # prompt words + completion tokens, as scripted


def test_another_users_chat_is_not_found(
    front_door: ScriptedFrontDoor, client: httpx.Client, chat_id: str, user: str
):
    with front_door.client(user + "-stranger") as stranger:
        assert_json_error(stranger.get(f"/v1/chats/{chat_id}"), 404)
        assert_json_error(stranger.post(f"/v1/chats/{chat_id}/messages", json={"content": "hi"}), 404)


# -- SSE --------------------------------------------------------------------------------------------


def test_quiet_streams_get_keep_alive_comments(client: httpx.Client, chat_id: str):
    # The test edge pings every second; one slow token makes the stream quiet for 2.5 s.
    with answer(client, chat_id, "slow !tokens 1 2500") as reply:
        lines = list(reply.iter_lines())
    assert any(line.startswith(":") for line in lines)


def test_run_error_event_ends_the_stream(client: httpx.Client, chat_id: str):
    events = send(client, chat_id, "fail later !runerror UNAVAILABLE 3")
    assert events[-1].event == "error" and events[-1].id is not None
    assert events[-1].data == {
        "code": "UNAVAILABLE",
        "message": "scripted UNAVAILABLE",
        "retry_after_ms": 2000,
    }


def test_stream_broken_mid_answer_ends_with_an_error_event_without_id(client: httpx.Client, chat_id: str):
    events = send(client, chat_id, "break !abort INTERNAL 2")
    assert events[-1].event == "error" and events[-1].id is None
    assert events[-1].data["code"] == "INTERNAL"
    assert [e.seq for e in events[:-1]] == list(range(1, len(events)))


def test_stream_of_a_chat_run_that_breaks_unavailable_is_attached_again_after_its_last_event(
    front_door: ScriptedFrontDoor, client: httpx.Client, chat_id: str
):
    # UNAVAILABLE: the replica streaming it is gone or draining, and the run goes on elsewhere.
    events = send(client, chat_id, "break !tokens 6 1 !abort UNAVAILABLE 2")
    assert events[-1].event == "done"
    # Each event once, in order (deltas that arrived together come as one, numbered as the last), and
    # every token once.
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)) and seqs[-1] == 9  # started, six deltas, usage, done
    assert sum(e.data["token_count"] for e in events if e.event == "delta") == 6
    again = front_door.scripted.calls_to("StreamRun")[-1].request
    assert again.run_id == events[0].data["run_id"] and again.after_seq == 3  # started + 2 deltas


def test_regenerate_and_edit_create_sibling_branches(client: httpx.Client, chat_id: str):
    first = send(client, chat_id, "first question !tokens 2 1")
    first_answer = first[-1].data["assistant_message_id"]
    second = send(client, chat_id, "second question !tokens 3 1")
    answer_id = second[-1].data["assistant_message_id"]
    question_id = second[0].data["user_message_id"]

    with client.stream("POST", f"/v1/chats/{chat_id}/messages/{answer_id}/regenerate", json={}) as reply:
        again = list(iter_events(reply))
    assert again[-1].event == "done" and again[-1].data["assistant_message_id"] != answer_id
    # Edit the second question: the new text follows the same parent (the first answer).
    edited = send(client, chat_id, "second question, edited !tokens 2 1", parent_message_id=first_answer)

    messages = {m["message_id"]: m for m in client.get(f"/v1/chats/{chat_id}/messages").json()["messages"]}
    regenerated = messages[again[-1].data["assistant_message_id"]]
    assert regenerated["parent_id"] == messages[answer_id]["parent_id"] == question_id
    edit = messages[edited[0].data["user_message_id"]]
    assert edit["parent_id"] == messages[question_id]["parent_id"] == first_answer


def test_idempotency_key_header_is_forwarded(
    front_door: ScriptedFrontDoor, client: httpx.Client, chat_id: str
):
    with client.stream(
        "POST",
        f"/v1/chats/{chat_id}/messages",
        json={"content": "once !tokens 1 1"},
        headers={"Idempotency-Key": "key-123"},
    ) as reply:
        list(iter_events(reply))
    assert front_door.scripted.calls_to("SendMessage")[-1].request.idempotency_key == "key-123"


# -- status codes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "extra", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, {}, 400),
        (grpc.StatusCode.INVALID_ARGUMENT, {"bad_field": "title"}, 400),
        (grpc.StatusCode.INVALID_ARGUMENT, {"error_reason": "PAYLOAD_TOO_LARGE"}, 413),
        (grpc.StatusCode.UNAUTHENTICATED, {}, 401),
        (grpc.StatusCode.PERMISSION_DENIED, {}, 403),
        (grpc.StatusCode.NOT_FOUND, {}, 404),
        (grpc.StatusCode.ALREADY_EXISTS, {}, 409),
        (grpc.StatusCode.FAILED_PRECONDITION, {}, 409),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, {"retry_after_s": 7.2}, 429),
        (grpc.StatusCode.UNAVAILABLE, {}, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, {}, 504),
    ],
    ids=lambda v: getattr(v, "name", None) or str(v),
)
def test_grpc_status_maps_to_http_status(
    front_door: ScriptedFrontDoor, client: httpx.Client, code, extra, status
):
    with front_door.scripted.failing("CreateChat", code, f"scripted {code.name}", **extra):
        reply = client.post("/v1/chats", json={})
    error = assert_json_error(reply, status)
    assert error["message"] == f"scripted {code.name}"
    if status == 429:
        assert reply.headers["retry-after"] == "8"  # 7.2 s, never rounded down
    if extra.get("bad_field"):
        assert error["param"] == "title"


def test_a_status_from_the_transport_is_a_503_to_retry_without_the_transports_text(
    front_door: ScriptedFrontDoor, client: httpx.Client, chat_id: str
):
    # The call travels on a completion link, where the transport's failure is the stream breaking (a
    # call shed by gRPC, CANCELLED, is test_completion_links.py's: only a call can be shed).
    transport_text = "Socket closed by 10.0.0.7:50050"
    with front_door.scripted.failing(
        "CreateChat", grpc.StatusCode.UNAVAILABLE, transport_text, transport=True
    ):
        reply = client.post("/v1/chats", json={})
    error = assert_json_error(reply, 503)
    assert "cannot be reached" in error["message"] and "10.0.0.7" not in error["message"]
    assert error["code"] == "unavailable" and reply.headers["retry-after"] == "1"


def test_a_send_whose_link_breaks_before_its_first_event_is_a_503_to_retry_without_the_transports_text(
    front_door: ScriptedFrontDoor, client: httpx.Client, chat_id: str
):
    # A send travels on a completion link, where the transport's failure is the stream breaking.
    transport_text = "Socket closed by 10.0.0.7:50050"
    with front_door.scripted.failing(
        "SendMessage", grpc.StatusCode.UNAVAILABLE, transport_text, transport=True
    ):
        reply = client.post(f"/v1/chats/{chat_id}/messages", json={"content": "hi"})
    error = assert_json_error(reply, 503)
    assert "cannot be reached" in error["message"] and "10.0.0.7" not in error["message"]
    assert reply.headers["retry-after"] == "1"


def test_internal_errors_do_not_leak_details(front_door: ScriptedFrontDoor, client: httpx.Client):
    with front_door.scripted.failing("CreateChat", grpc.StatusCode.INTERNAL, "NullPointer at db.py:12"):
        reply = client.post("/v1/chats", json={})
    assert "db.py" not in assert_json_error(reply, 500)["message"]


def test_stream_refused_before_its_first_event_gets_an_http_status(
    front_door: ScriptedFrontDoor, client: httpx.Client, chat_id: str
):
    with front_door.scripted.failing(
        "SendMessage", grpc.StatusCode.RESOURCE_EXHAUSTED, "budget spent", retry_after_s=30
    ):
        reply = client.post(f"/v1/chats/{chat_id}/messages", json={"content": "hi"})
    assert assert_json_error(reply, 429)["message"] == "budget spent"
    assert reply.headers["retry-after"] == "30"
    assert reply.headers["content-type"].startswith("application/json")


# -- bad input never reaches the chat service --------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "headers", "status", "says"),
    [
        (b'{"content": "hi"', {}, 400, "malformed JSON"),
        (b'{"content": "\xff\xfe"}', {}, 400, "not valid UTF-8"),
        (b'{"content": "\\ud800"}', {}, 400, "surrogate"),
        (b"[1, 2]", {}, 400, "JSON object"),
        (b"", {}, 400, "empty"),
        (b'{"content": NaN}', {}, 400, "NaN"),
        (b'{"content": 42}', {}, 400, "content"),
        (b'{"content": ""}', {}, 400, "content"),
        (b'{"content": "hi", "colour": "red"}', {}, 400, "colour"),
        (b'{"content": "hi", "options": {"temperature": 3}}', {}, 400, "options.temperature"),
        (b'{"content": "hi", "options": {"max_tokens": 4294967296}}', {}, 400, "options.max_tokens"),
        (b'{"content": "hi", "options": {"seed": 18446744073709551616}}', {}, 400, "options.seed"),
        (b'{"content": "hi", "options": {"max_tokens": ' + b"9" * 4301 + b"}}", {}, 400, "too many digits"),
        (b'{"content": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400, "nested more than"),
        (b'{"content": "hi", "x": ' + b"[" * 33 + b"]" * 33 + b"}", {}, 400, "nested more than"),
        (b'{"content": "hi"}', {"Content-Type": "text/plain"}, 415, "content type"),
        (b'{"content": "' + b"x" * (70 * 1024) + b'"}', {}, 413, "limit of 65536 bytes"),
    ],
    ids=[
        "truncated",
        "invalid-utf8",
        "lone-surrogate",
        "not-object",
        "empty",
        "nan",
        "wrong-type",
        "empty-content",
        "unknown-field",
        "out-of-range",
        "max-tokens-past-uint32",
        "seed-past-uint64",
        "int-over-4300-digits",
        "nested-5000-deep",
        "nested-33-deep",
        "content-type",
        "body-too-large",
    ],
)
def test_bad_request_bodies_are_refused_without_calling_the_chat_service(
    front_door: ScriptedFrontDoor,
    client: httpx.Client,
    chat_id: str,
    body: bytes,
    headers: dict,
    status: int,
    says: str,
):
    before = len(front_door.scripted.calls_to("SendMessage"))
    reply = client.post(
        f"/v1/chats/{chat_id}/messages", content=body, headers={"Content-Type": "application/json", **headers}
    )
    assert says in assert_json_error(reply, status)["message"]
    assert len(front_door.scripted.calls_to("SendMessage")) == before
    assert client.get(f"/v1/chats/{chat_id}/messages").json()["messages"] == []


def test_malformed_ids_and_cursors_are_refused_at_the_edge(
    front_door: ScriptedFrontDoor, client: httpx.Client
):
    before = len(front_door.scripted.calls)
    assert_json_error(client.get("/v1/chats/bad%20id"), 404)
    for page_size in ("-1", "1000", "²", "٣", "9" * 5000, "1.5"):
        error = assert_json_error(client.get("/v1/chats", params={"page_size": page_size}), 400)
        assert (error["type"], error["param"]) == ("invalid_request_error", "page_size")
    for last_event_id in ("abc", "²", str(2**64), "9" * 5000, "-1"):
        # Latin-1 on the wire, as a client may send "²".
        reply = client.get(
            "/v1/runs/run_x/events", headers={"Last-Event-ID": last_event_id.encode("latin-1")}
        )
        assert assert_json_error(reply, 400)["param"] == "Last-Event-ID"
    reply = client.get("/v1/runs/run_x/events", params={"after_seq": str(2**64)})
    assert assert_json_error(reply, 400)["param"] == "after_seq"
    assert len(front_door.scripted.calls) == before


def test_unknown_routes_and_methods_answer_json_errors(client: httpx.Client):
    assert_json_error(client.get("/v1/nothing-here"), 404)
    assert_json_error(client.put("/v1/chats"), 405)


def test_edge_exports_prometheus_metrics(front_door: ScriptedFrontDoor, client: httpx.Client, chat_id: str):
    send(client, chat_id, "metrics !tokens 2 1")
    metrics = httpx.get(front_door.edge.metrics_url).text
    assert (
        'chatmesh_edge_http_requests_total{method="POST",route="/v1/chats/{chat_id}/messages",status="200"}'
        in metrics
    )
    assert 'chatmesh_edge_stream_events_total{event="delta",kind="run"}' in metrics
    assert "chatmesh_edge_time_to_first_delta_seconds_bucket" in metrics
    wait_for(
        lambda: 'chatmesh_edge_open_streams{kind="run"} 0.0' in httpx.get(front_door.edge.metrics_url).text,
        what="the open-streams gauge to return to 0",
    )
