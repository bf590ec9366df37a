"""Envoy as the front door, through the real Envoy binary, in front of the real edge and a real gRPC server
(ScriptedChatService, not the orchestrator): authentication, identity headers, rate limits, CORS, health,
gRPC routing with deadlines and retries, access log."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.errors import retry_after_s
from chatmesh.identity import CHAT_ID_HEADER, TIER_HEADER, USER_ID_HEADER
from localmesh.dev_jwt import generate_keys
from tests.front_door.conftest import EDGE_IDLE_TIMEOUT_S, UNARY_TIMEOUT_S, ScriptedFrontDoor
from tests.front_door.helpers import assert_json_error, wait_for
from tests.front_door.sse_client import iter_events

# -- authentication ---------------------------------------------------------------------------------


def test_request_without_token_is_401_and_never_reaches_the_edge(front_door: ScriptedFrontDoor):
    before = len(front_door.scripted.calls)
    reply = httpx.get(f"{front_door.url}/v1/chats")
    error = assert_json_error(reply, 401)
    assert "Jwt is missing" in error["message"]
    assert reply.headers["www-authenticate"].startswith("Bearer")
    assert len(front_door.scripted.calls) == before


@pytest.mark.parametrize("problem", ["foreign key", "expired", "garbage"])
def test_bad_token_is_401(front_door: ScriptedFrontDoor, tmp_path, problem: str):
    keys = front_door.envoy.keys
    token = {
        "foreign key": lambda: generate_keys(tmp_path / "other").mint("mallory", "enterprise"),
        "expired": lambda: keys.mint("alice", "pro", ttl_s=-120),
        "garbage": lambda: "not.a.jwt",
    }[problem]()
    reply = httpx.get(f"{front_door.url}/v1/me", headers={"Authorization": f"Bearer {token}"})
    assert_json_error(reply, 401)


def test_genuine_token_for_another_audience_is_403(front_door: ScriptedFrontDoor):
    token = front_door.envoy.keys.mint("alice", "pro", audience="someone-else")
    reply = httpx.get(f"{front_door.url}/v1/me", headers={"Authorization": f"Bearer {token}"})
    assert "Audiences" in assert_json_error(reply, 403)["message"]


def test_valid_token_identity_reaches_the_edge(front_door: ScriptedFrontDoor, user: str):
    with front_door.client(user, "enterprise") as client:
        assert client.get("/v1/me").json() == {"user_id": user, "tier": "enterprise"}


def test_forged_identity_headers_with_a_valid_token_are_overwritten(front_door: ScriptedFrontDoor, user: str):
    forged = {USER_ID_HEADER: "victim", TIER_HEADER: "enterprise"}
    with front_door.client(user, "free") as client:
        assert client.get("/v1/me", headers=forged).json() == {"user_id": user, "tier": "free"}
        chat = client.post("/v1/chats", json={"title": "mine"}, headers=forged).json()
        # The edge passes on the caller's token, and nothing of the forged headers.
        call = front_door.scripted.calls_to("CreateChat")[-1]
        assert call.metadata["authorization"] == client.headers["authorization"]
        assert USER_ID_HEADER not in call.metadata and TIER_HEADER not in call.metadata
    assert front_door.scripted.chats[chat["chat_id"]][0] == user


def test_forged_identity_header_without_a_token_is_401(front_door: ScriptedFrontDoor):
    reply = httpx.get(f"{front_door.url}/v1/me", headers={USER_ID_HEADER: "victim", TIER_HEADER: "pro"})
    assert_json_error(reply, 401)


def test_edge_refuses_requests_that_did_not_come_through_envoy(front_door: ScriptedFrontDoor):
    # Defence in depth: the edge itself reached without identity headers answers 401.
    assert_json_error(httpx.get(f"{front_door.edge.url}/v1/chats"), 401)


# -- rate limits --------------------------------------------------------------------------------------


def test_rate_limit_per_user_answers_429_with_retry_after(front_door: ScriptedFrontDoor, user: str):
    with front_door.client(user, "free") as client:
        statuses = [client.get("/v1/me").status_code for _ in range(12)]
        limited = client.get("/v1/me")
    assert statuses[:8] == [200] * 8, statuses  # the test config's free-tier burst
    assert 429 in statuses
    error = assert_json_error(limited, 429)
    assert error["type"] == "envoy"
    assert int(limited.headers["retry-after"]) >= 1
    # Buckets are per user: someone else on the same tier is unaffected.
    with front_door.client(user + "-other", "free") as other:
        assert other.get("/v1/me").status_code == 200
    # And per tier: a pro user has a bigger bucket.
    with front_door.client(user + "-pro", "pro") as pro:
        assert {pro.get("/v1/me").status_code for _ in range(12)} == {200}


def test_generation_routes_have_their_own_tighter_limit(front_door: ScriptedFrontDoor, user: str):
    with front_door.client(user, "free") as client:
        chat_id = client.post("/v1/chats", json={}).json()["chat_id"]
        statuses = [
            client.post(f"/v1/chats/{chat_id}/messages", json={"content": "hi !tokens 1 1"}).status_code
            for _ in range(4)
        ]
        # Reads still work: a separate bucket.
        assert client.get(f"/v1/chats/{chat_id}").status_code == 200
    assert statuses[:2] == [200, 200] and statuses[2:] == [429, 429], statuses


# -- CORS, health, access log -------------------------------------------------------------------------


def test_cors_preflight_is_answered_without_a_token_for_allowed_origins(front_door: ScriptedFrontDoor):
    preflight = {
        "Origin": "http://app.example.test",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, last-event-id",
    }
    reply = httpx.options(f"{front_door.url}/v1/chats", headers=preflight)
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == "http://app.example.test"
    assert "POST" in reply.headers["access-control-allow-methods"]
    assert "last-event-id" in reply.headers["access-control-allow-headers"]

    denied = httpx.options(f"{front_door.url}/v1/chats", headers={**preflight, "Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in denied.headers


def test_cors_headers_on_actual_responses_expose_retry_after(front_door: ScriptedFrontDoor, user: str):
    reply = httpx.get(
        f"{front_door.url}/v1/me", headers={**front_door.auth(user), "Origin": "http://app.example.test"}
    )
    assert reply.headers["access-control-allow-origin"] == "http://app.example.test"
    assert "retry-after" in reply.headers["access-control-expose-headers"]


def test_envoy_answers_its_own_health_endpoint(front_door: ScriptedFrontDoor):
    reply = httpx.get(f"{front_door.url}/healthz")
    assert reply.status_code == 200
    assert reply.headers["server"] == "envoy"
    # Answered by Envoy itself: no upstream was involved.
    assert "x-envoy-upstream-service-time" not in reply.headers


def test_access_log_records_user_status_and_trace(front_door: ScriptedFrontDoor, user: str):
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with front_door.client(user) as client:
        client.get("/v1/me", headers={"traceparent": traceparent})

    def entry():
        for line in front_door.access_log().splitlines():
            if line.startswith("{") and user in line:
                return json.loads(line)
        return None

    logged = wait_for(entry, what="the access log line")
    assert logged["path"] == "/v1/me" and logged["status"] == 200 and logged["upstream_cluster"] == "edge"
    assert logged["traceparent"] == traceparent


def test_w3c_trace_context_reaches_the_chat_service(front_door: ScriptedFrontDoor, user: str):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with front_door.client(user) as client:
        client.post("/v1/chats", json={}, headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
    received = front_door.scripted.calls_to("CreateChat")[-1].metadata.get("traceparent", "")
    assert received.split("-")[1] == trace_id


# -- gRPC through Envoy -----------------------------------------------------------------------------


@pytest.fixture
def grpc_stub(front_door: ScriptedFrontDoor):
    with grpc.insecure_channel(front_door.envoy.grpc_target) as channel:
        yield chat_pb2_grpc.ChatServiceStub(channel)


def bearer(front_door: ScriptedFrontDoor, user: str, tier: str = "pro") -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {front_door.envoy.token(user, tier)}"),)


def test_grpc_call_without_token_is_unauthenticated(front_door: ScriptedFrontDoor, grpc_stub):
    with pytest.raises(grpc.RpcError) as failure:
        grpc_stub.ListChats(chat_pb2.ListChatsRequest(), timeout=5)
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_identity_comes_from_the_token_not_from_client_metadata(
    front_door: ScriptedFrontDoor, grpc_stub, user: str
):
    forged = ((USER_ID_HEADER, "victim"), (TIER_HEADER, "enterprise"))
    token = f"Bearer {front_door.envoy.token(user, 'free')}"
    reply = grpc_stub.CreateChat(
        chat_pb2.CreateChatRequest(title="grpc"), metadata=(("authorization", token), *forged), timeout=5
    )
    assert front_door.scripted.chats[reply.chat.chat_id][0] == user
    call = front_door.scripted.calls_to("CreateChat")[-1]
    assert (call.metadata[USER_ID_HEADER], call.metadata[TIER_HEADER]) == (user, "free")
    # The token itself goes on: the service behind Envoy proves the caller with it, not with the headers.
    assert call.metadata["authorization"] == token


def test_grpc_deadline_is_enforced_through_envoy(front_door: ScriptedFrontDoor, grpc_stub, user: str):
    chat = grpc_stub.CreateChat(
        chat_pb2.CreateChatRequest(), metadata=bearer(front_door, user), timeout=5
    ).chat
    with front_door.scripted.delay("GetChat", 1.5):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            grpc_stub.GetChat(
                chat_pb2.GetChatRequest(chat_id=chat.chat_id), metadata=bearer(front_door, user), timeout=0.3
            )
        elapsed = time.monotonic() - started
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < 1.2


def test_grpc_stream_outlives_the_unary_route_timeout(front_door: ScriptedFrontDoor, grpc_stub, user: str):
    metadata = bearer(front_door, user)
    chat = grpc_stub.CreateChat(chat_pb2.CreateChatRequest(), metadata=metadata, timeout=5).chat
    tokens = int((UNARY_TIMEOUT_S + 1.0) / 0.05)
    started = time.monotonic()
    events = [
        r.event
        for r in grpc_stub.SendMessage(
            chat_pb2.SendMessageRequest(chat_id=chat.chat_id, content=f"long !tokens {tokens} 50"),
            metadata=(*metadata, (CHAT_ID_HEADER, chat.chat_id)),
            timeout=30,
        )
    ]
    assert time.monotonic() - started > UNARY_TIMEOUT_S
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert sum(e.WhichOneof("kind") == "delta" for e in events) == tokens
    assert events[-1].done.finish_reason == chat_pb2.FINISH_REASON_STOP


def test_envoy_retries_idempotent_calls_only(front_door: ScriptedFrontDoor, grpc_stub, user: str):
    metadata = bearer(front_door, user)
    chat = grpc_stub.CreateChat(chat_pb2.CreateChatRequest(), metadata=metadata, timeout=5).chat
    service = front_door.scripted
    with service.failing("GetChat", grpc.StatusCode.UNAVAILABLE, "blip", times=1):
        before = len(service.calls_to("GetChat"))
        reply = grpc_stub.GetChat(chat_pb2.GetChatRequest(chat_id=chat.chat_id), metadata=metadata, timeout=5)
        assert reply.chat.chat_id == chat.chat_id
        assert len(service.calls_to("GetChat")) == before + 2  # failed once, retried by Envoy
    with service.failing("CreateChat", grpc.StatusCode.UNAVAILABLE, "blip", times=1):
        before = len(service.calls_to("CreateChat"))
        with pytest.raises(grpc.RpcError) as failure:
            grpc_stub.CreateChat(chat_pb2.CreateChatRequest(), metadata=metadata, timeout=5)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(service.calls_to("CreateChat")) == before + 1  # never replayed: it is not idempotent


def test_grpc_retry_info_passes_through_envoy(front_door: ScriptedFrontDoor, grpc_stub, user: str):
    with (
        front_door.scripted.failing(
            "ListModels", grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_after_s=4
        ),
        pytest.raises(grpc.RpcError) as failure,
    ):
        grpc_stub.ListModels(chat_pb2.ListModelsRequest(), metadata=bearer(front_door, user), timeout=5)
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_after_s(failure.value) == 4.0


def envoy_edge_connections(front_door: ScriptedFrontDoor) -> dict[str, int]:
    """Envoy's counters and gauges of its connections and requests to the edge (admin /stats)."""
    reply = httpx.get(
        f"http://127.0.0.1:{front_door.envoy.config.admin_port}/stats",
        params={"filter": r"^cluster\.edge\.upstream_(cx|rq)_", "format": "json"},
        timeout=5,
    )
    stats = reply.json()["stats"]
    return {stat["name"].removeprefix("cluster.edge."): stat["value"] for stat in stats if "name" in stat}


def test_envoy_closes_an_idle_connection_to_the_edge_before_the_edge_does(
    front_door: ScriptedFrontDoor, user: str
):
    # Whoever closes an idle keep-alive connection first must be Envoy: when the edge did (uvicorn's
    # 5 s default against Envoy's hour), a request Envoy sent on a connection the edge was closing
    # failed 503 "connection termination" (3 of 2,000 streams opened at once in the hold ramp).
    before = envoy_edge_connections(front_door)
    with front_door.client(user) as client:
        assert client.get("/v1/chats").status_code == 200
    after = wait_for(
        lambda: (
            (now := envoy_edge_connections(front_door))["upstream_cx_idle_timeout"]
            > before["upstream_cx_idle_timeout"]
            and now
        ),
        timeout_s=EDGE_IDLE_TIMEOUT_S + 5,
        what="Envoy to close its idle connection to the edge",
    )
    assert after["upstream_cx_destroy_remote"] == before["upstream_cx_destroy_remote"]


def test_open_answer_streams_share_envoys_http2_connections_to_the_edge(
    front_door: ScriptedFrontDoor, user: str
):
    # Over HTTP/1.1 each open SSE stream held a connection from Envoy to the edge: two sockets in Envoy
    # per stream, which capped one Envoy near 10,000 streams (its 20,000 open files). Over HTTP/2 the
    # streams share one per Envoy worker thread (each worker keeps its own pool of connections).
    workers = httpx.get(f"http://127.0.0.1:{front_door.envoy.config.admin_port}/server_info").json()[
        "command_line_options"
    ]["concurrency"]
    streams = 4 * workers
    all_open = threading.Barrier(streams + 1, timeout=30)

    def answer(i: int) -> str:
        with front_door.client(f"{user}-{i}") as client:
            chat_id = client.post("/v1/chats", json={}).json()["chat_id"]
            body = {"content": "shared !tokens 40 50"}
            with client.stream("POST", f"/v1/chats/{chat_id}/messages", json=body) as reply:
                events = iter_events(reply)
                next(events)
                all_open.wait()  # every stream has its first event ...
                all_open.wait()  # ... until Envoy's stats are read
                return [event.event for event in events][-1]

    before = envoy_edge_connections(front_door)
    with ThreadPoolExecutor(streams) as pool:
        answers = [pool.submit(answer, i) for i in range(streams)]
        all_open.wait()
        during = envoy_edge_connections(front_door)
        all_open.wait()
        assert [answer.result() for answer in answers] == ["done"] * streams
    assert during["upstream_rq_active"] >= streams
    assert during["upstream_cx_active"] <= workers
    assert during["upstream_cx_http1_total"] == before["upstream_cx_http1_total"]
