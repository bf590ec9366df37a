"""The edge's SSE response sends each event without a cancel scope of its own (edge/sse.py:_EventStream
overrides a private method of the pinned sse-starlette): an upgrade that stops calling it fails here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import sse_starlette.sse
from sse_starlette import ServerSentEvent

from edge.sse import StreamSettings, sse_response


async def test_events_are_sent_without_a_cancel_scope_each(monkeypatch: pytest.MonkeyPatch) -> None:
    scopes = 0
    real = sse_starlette.sse.anyio.move_on_after

    def counted(*args, **kwargs):
        nonlocal scopes
        scopes += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(sse_starlette.sse.anyio, "move_on_after", counted)

    async def events() -> AsyncIterator[ServerSentEvent]:
        for i in range(3):
            yield ServerSentEvent(data=f"event {i}")

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    response = sse_response(events(), StreamSettings())
    scope = {"type": "http", "asgi": {"version": "3.0"}, "method": "GET", "path": "/", "headers": []}
    await response(scope, receive, send)
    bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert [line for line in bodies.decode().splitlines() if line.startswith("data:")] == [
        f"data: event {i}" for i in range(3)
    ]
    assert scopes == 0
