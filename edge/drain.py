"""The edge's shutdown: a deadline every open stream, and every wait for a stream's first event, obeys."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from meshkit.deadline import Deadline


class Drain:
    """Ends open streams cleanly when the edge shuts down.

    ``start(grace_s)`` (on SIGTERM) sets a deadline; every stream waiting for its next event stops
    waiting then and ends its response normally, without a final event, so clients resume with
    Last-Event-ID on another replica while the run itself goes on.
    """

    def __init__(self) -> None:
        self.deadline: float | None = None
        self._watching: set[Deadline] = set()

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self, grace_s: float) -> None:
        self.deadline = asyncio.get_running_loop().time() + grace_s
        for deadline in self._watching:
            deadline.reschedule(self.deadline)

    @contextmanager
    def watch(self) -> Iterator[Deadline]:
        """The drain's deadline for the calling task's waits (``Deadline.wait`` raises TimeoutError once
        it passes), while the block lasts: one for a whole stream."""
        with Deadline(self.deadline) as deadline:
            self._watching.add(deadline)
            try:
                yield deadline
            finally:
                self._watching.discard(deadline)
