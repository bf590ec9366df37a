"""A call whose client leaves before its reply: the work behind a non-streamed reply stops with it.

A non-streamed answer is read to its end before anything is sent, and the HTTP server does not cancel
a handler whose client has gone: left alone, a Complete nobody reads would generate to its end, be
charged in full and hold one of the user's run slots. The handler's work is therefore raced against
the client's leaving, which the server reports as ASGI's ``http.disconnect`` (Envoy resets the call's
HTTP/2 stream when its client closes); work cancelled closes the run stream it reads, which detaches
from the run, and so cancels a Complete (as sse-starlette's listening does for a streamed answer). A
stored chat's run is not stopped by a detach: it outlives its caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")

# nginx's "client closed request": what the edge's metrics count for a call nobody was left to answer.
CLIENT_CLOSED_REQUEST = 499


class ClientGone(Exception):
    """The client left before its reply was ready: its work was cancelled, and nobody reads a reply."""


async def unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, if it comes while the client is connected. If the client leaves first, ``work``
    is cancelled (and awaited: its run stream is closed on return) and ClientGone is raised. Call it
    after the request's body has been read: what the server receives next is the client's leaving."""
    working = asyncio.ensure_future(work)
    leaving = asyncio.ensure_future(_left(request))
    try:
        await asyncio.wait((working, leaving), return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        if not working.done():
            working.cancel()
            await asyncio.wait((working,))
    if working.cancelled() and leaving.done() and not leaving.cancelled():
        # The client left (a receive that failed says as much): nobody reads a reply.
        raise ClientGone from leaving.exception()
    return working.result()


async def _left(request: Request) -> None:
    """Returns when the client has left (the body is read: the server has nothing else to deliver)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def client_gone(_: Request, exc: Exception) -> Response:
    """The reply to a call whose client left: sent to nobody, counted by status."""
    assert isinstance(exc, ClientGone)
    return Response(status_code=CLIENT_CLOSED_REQUEST)
