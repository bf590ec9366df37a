"""The edge's HTTP server (edge/__main__.py: granian on the edge's own event loop) against a real socket:
after SIGTERM the process ends within the drain's grace plus a margin even when a response never ends
(a client that stopped reading, a stream that ignores the drain). The drain of real answer streams is
tests/front_door/test_edge_drain.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
from sse_starlette.sse import AppStatus
from starlette.types import Receive, Scope, Send

from edge.__main__ import CLOSE_MARGIN_S, http_server, serve
from edge.drain import Drain
from edge.settings import EdgeSettings
from meshkit.launcher import free_port

# Longer than the grace and the margin together, so only the server's own cut-off can end the wait.
STREAM_S = 8.0


async def stubborn_stream(scope: Scope, receive: Receive, send: Send) -> None:
    """An ASGI app whose responses stream for STREAM_S whatever happens (it never looks at the drain)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    ends = time.monotonic() + STREAM_S
    while time.monotonic() < ends:
        await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
        await asyncio.sleep(0.1)
    await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def sse_starlette_status() -> Iterator[None]:
    """``serve`` tells sse-starlette the process is exiting (process-wide): undone after the test."""
    yield
    AppStatus.should_exit = False


async def test_sigterm_ends_the_server_after_the_grace_even_with_a_response_still_open(sse_starlette_status):
    port, grace_s = free_port(), 0.5
    server = http_server(stubborn_stream, "127.0.0.1", port, EdgeSettings())
    serving = asyncio.create_task(serve(server, Drain(), grace_s))
    reader, writer = await _connect(port)
    try:
        writer.write(b"GET /stream HTTP/1.1\r\nHost: edge\r\n\r\n")
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        signalled = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, grace_s + CLOSE_MARGIN_S + 2)
        took = time.monotonic() - signalled
        # Not before the grace (the stream had it), not after the margin (nor at the stream's end).
        assert grace_s <= took < grace_s + CLOSE_MARGIN_S + 1 < STREAM_S
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        writer.close()
    # The signal handlers went with the server: SIGTERM is the default again.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    for _ in range(100):
        try:
            return await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"the edge's server never listened on {port}")
