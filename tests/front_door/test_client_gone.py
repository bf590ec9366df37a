"""A non-streamed reply's work against its client's leaving (pure logic: an ASGI ``receive`` the test
drives; through Envoy and the mesh: test_mesh_apis.py's dropped calls)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from edge.client_gone import ClientGone, unless_client_leaves
from edge.errors import ApiError


def request_until(left: asyncio.Event) -> Request:
    """A request whose body is read; the server's next message is the client's leaving, once ``left``."""

    async def receive() -> dict:
        await left.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


async def test_work_that_ends_first_is_the_reply_and_its_errors_are_the_clients() -> None:
    async def answer() -> str:
        return "answer"

    async def refused() -> str:
        raise ApiError(429, "at capacity")

    assert await unless_client_leaves(request_until(asyncio.Event()), answer()) == "answer"
    with pytest.raises(ApiError):
        await unless_client_leaves(request_until(asyncio.Event()), refused())


async def test_a_client_that_leaves_cancels_the_work_before_the_handler_goes_on() -> None:
    left, reading, closed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def read_to_the_end() -> str:
        try:
            reading.set()
            await asyncio.Event().wait()  # a run that would go on
            return "never"
        finally:
            closed.set()  # its run stream closes here

    handler = asyncio.create_task(unless_client_leaves(request_until(left), read_to_the_end()))
    await reading.wait()
    left.set()
    with pytest.raises(ClientGone):
        await handler
    assert closed.is_set()


async def test_a_handler_cancelled_itself_cancels_its_work() -> None:
    reading, closed = asyncio.Event(), asyncio.Event()

    async def read_to_the_end() -> None:
        try:
            reading.set()
            await asyncio.Event().wait()
        finally:
            closed.set()

    handler = asyncio.create_task(unless_client_leaves(request_until(asyncio.Event()), read_to_the_end()))
    await reading.wait()
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    assert closed.is_set()
