"""The edge's shutdown: a deadline every open stream, and every wait for a stream's first event, obeys."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Drain:
    """Ends open streams cleanly when the edge shuts down.

    ``start(grace_s)`` (on SIGTERM) sets a deadline; every stream waiting for its next event stops
    waiting then and ends its response normally, without a final event, so clients resume with
    Last-Event-ID on another replica while the run itself goes on.
    """

    def __init__(self) -> None:
        self.deadline: float | None = None
        self._waiting: set[asyncio.Timeout] = set()

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self, grace_s: float) -> None:
        self.deadline = asyncio.get_running_loop().time() + grace_s
        for timeout in self._waiting:
            timeout.reschedule(self.deadline)

    @asynccontextmanager
    async def bounded(self) -> AsyncIterator[None]:
        """Raises TimeoutError inside if the drain deadline passes first."""
        async with asyncio.timeout_at(self.deadline) as timeout:
            self._waiting.add(timeout)
            try:
                yield
            finally:
                self._waiting.discard(timeout)
