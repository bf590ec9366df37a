"""A lean HTTP/1.1 client for server-sent events, for benchmarks that hold thousands of streams.

httpx checks every idle pooled connection each time it hands one out (a poll() and a getpeername() per
connection), so a client holding N streams spends O(N) per new request: at 2,000 streams the benchmark's
own client used a whole core and was still opening streams when the door had answered the others. Here
each stream is one socket of its own, written once and read line by line (chunked transfer encoding).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator


class SseFailedError(RuntimeError):
    """The server answered with an HTTP error status."""


async def post_events(
    host: str, port: int, path: str, body: dict, headers: dict[str, str]
) -> AsyncIterator[tuple[str, str]]:
    """POSTs ``body`` as JSON and yields each event of the response as (its ``event:`` name, ``message``
    when it has none; its ``data:`` value)."""
    payload = json.dumps(body).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n{head}\r\n".encode()
            + payload
        )
        status_line = await reader.readline()
        if not status_line:
            raise SseFailedError("the connection closed before a response")
        status = int(status_line.split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
        if status != 200:
            raise SseFailedError(f"HTTP {status}: {(await reader.read(200))!r}")
        name = "message"
        async for line in _lines(reader, chunked):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                yield name, line[6:]
            elif not line:  # an event ends at a blank line
                name = "message"
    finally:
        writer.close()


async def _lines(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[str]:
    """The body's lines, undoing chunked transfer encoding (chunks need not end at line ends)."""
    if not chunked:
        while line := await reader.readline():
            yield line.decode().rstrip("\r\n")
        return
    pending = b""
    while size := int((await reader.readline()).split(b";")[0], 16):
        pending += await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.decode().rstrip("\r")
