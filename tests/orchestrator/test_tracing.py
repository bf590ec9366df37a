"""One trace crosses every gRPC hop: a send that arrives with W3C trace context leaves spans in the
orchestrator, the router and the engine, each hop's server span the child of the previous hop's client
span. Spans come from the services' own exporters (``CHATMESH_TRACE_FILE``, set for every test process)."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from chatmesh.chat.v1 import chat_pb2
from meshkit.telemetry import TRACE_FILE_ENV
from tests.fixtures.orchestrator import ChatClient, collect


def spans_of(trace_id: str) -> list[dict]:
    path = Path(os.environ[TRACE_FILE_ENV])
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [span for line in f if trace_id in line and (span := json.loads(line))["trace_id"] == trace_id]


def wait_for_trace(trace_id: str, services: set[str], timeout_s: float = 20.0) -> list[dict]:
    """The trace's spans once every service has one and every server span's caller span is in too (a
    client span is written when its stream ends, a moment after the server's)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = spans_of(trace_id)
        ids = {s["span_id"] for s in spans}
        callers_in = all(
            s["parent_span_id"] in ids
            for s in spans
            if s["kind"] == "SERVER" and s["service"] != "orchestrator"
        )
        if (services <= {s["service"] for s in spans} and callers_in) or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


async def test_a_send_is_one_trace_through_orchestrator_router_and_engine(client: ChatClient) -> None:
    trace_id = uuid.uuid4().hex
    caller_span_id = uuid.uuid4().hex[:16]
    chat = await client.create_chat()
    call = client.stub.SendMessage(
        chat_pb2.SendMessageRequest(
            chat_id=chat.chat_id, content="trace me", options=chat_pb2.GenerationOptions(max_tokens=4)
        ),
        metadata=(*client.metadata(chat.chat_id), ("traceparent", f"00-{trace_id}-{caller_span_id}-01")),
        timeout=60,
    )
    assert (await collect(call))[-1].WhichOneof("kind") == "done"

    spans = wait_for_trace(trace_id, {"orchestrator", "router", "engine"})
    by_id = {s["span_id"]: s for s in spans}

    def server_span(service: str, method: str) -> dict:
        found = [
            s
            for s in spans
            if s["service"] == service and s["kind"] == "SERVER" and s["name"].endswith(method)
        ]
        assert found, (
            f"no {service} server span for {method} in trace {trace_id}: {[(s['service'], s['name']) for s in spans]}"
        )
        return found[0]

    def caller_of(span: dict) -> dict:
        parent = by_id.get(span["parent_span_id"])
        assert parent is not None and parent["kind"] == "CLIENT", (
            f"{span['name']} has no client parent in the trace"
        )
        return parent

    send = server_span("orchestrator", "SendMessage")
    assert send["parent_span_id"] == caller_span_id
    route = server_span("router", "Generate")
    assert caller_of(route)["service"] == "orchestrator"
    generate = server_span("engine", "Generate")
    assert caller_of(generate)["service"] == "router"
