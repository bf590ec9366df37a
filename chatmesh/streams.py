"""Client-side helpers for streaming gRPC calls, shared by the services that make them."""

from __future__ import annotations

import asyncio

import grpc

# How long a peer may take to end a call after its last meaningful frame.
END_OF_CALL_TIMEOUT_S = 5.0


async def read_to_end(call: grpc.aio.StreamStreamCall, timeout_s: float = END_OF_CALL_TIMEOUT_S) -> None:
    """Reads a call's remaining responses up to its status, or cancels it if that fails or takes longer
    than ``timeout_s``. Call it once the last frame that matters has arrived (and the request side is
    closed): a call left unread completes only when it is garbage-collected, and so does its client
    trace span, which then never joins the trace in time."""
    try:
        async with asyncio.timeout(timeout_s):
            while await call.read() is not grpc.aio.EOF:
                pass
    except (TimeoutError, grpc.aio.AioRpcError):
        call.cancel()
