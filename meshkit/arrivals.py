"""What waits for an asyncio consumer: a ``Wakeup`` that wakes the tasks waiting on it, and ``Arrivals``,
the frames of one stream that arrived and were not taken yet (a request's feed on a link,
``meshkit.links.RequestFeed``; a run's output in the orchestrator waits on a ``Wakeup``)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

Frame = TypeVar("Frame")


class Wakeup:
    """Wakes the tasks waiting on it: ``asyncio.Event``'s job on a path taken for every token, without
    its cost there. ``Event.wait`` asks for the running loop on every call, and on Python 3.11 that asks
    the kernel for the process id: a system call per token per hop (with asyncio's timeouts, which ask
    too, 13 % of the orchestrator's main thread at 3,000 open streams: py-spy). This one keeps the loop
    it first waited on. It has no flag to set or clear: ``wait`` returns at the next ``notify``, so a
    waiter checks its condition first, with no ``await`` between the check and ``wait``."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait(self) -> None:
        waiter = self._waiter()
        try:
            await waiter
        finally:
            if waiter.cancelled() and waiter in self._waiters:
                self._waiters.remove(waiter)

    async def wait_or(self, other: Wakeup) -> None:
        """Returns at the next notify of this one or of ``other``. The waiter leaves ``other``'s list as
        it returns and this one's at its next notify (taking it off a list is a walk of the list), so
        ``other`` is the one with few waiters: a run's end beside a tick every stream waits on."""
        waiter = self._waiter()
        other._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in other._waiters:
                other._waiters.remove(waiter)
            if waiter.cancelled() and waiter in self._waiters:
                self._waiters.remove(waiter)

    def _waiter(self) -> asyncio.Future[None]:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        return waiter


class Arrivals(Generic[Frame]):
    """Frames that arrived and were not taken yet, then how the stream of them ended. ``take`` returns
    every frame that arrived since the last ``take``: a consumer that keeps up gets them one by one, as
    soon as each arrives; one that fell behind (its own writes waiting on a slow client) gets them all
    at once, and can merge them into one message instead of paying gRPC's per-message cost for each.
    What waits here is bounded by the stream's own output; nothing is dropped."""

    def __init__(self) -> None:
        self._frames: deque[Frame] = deque()
        self._error: BaseException | None = None
        self.ended = False
        self._arrived = Wakeup()

    def add(self, frame: Frame) -> None:
        self._frames.append(frame)
        self._arrived.notify()

    @property
    def queued(self) -> int:
        """Frames that arrived and were not taken yet."""
        return len(self._frames)

    def end(self, error: BaseException | None = None) -> None:
        """No frame comes after this; ``take`` raises ``error``, if any, once the frames before it are
        taken. Only the first end counts."""
        if not self.ended:
            self.ended, self._error = True, error
            self._arrived.notify()

    async def take(self) -> list[Frame]:
        """Waits for at least one frame; returns all that have arrived, oldest first. Returns [] once the
        stream has ended well and everything was taken; raises its error after the frames before it."""
        while not self._frames:
            if self.ended:
                if self._error is not None:
                    raise self._error
                return []
            await self._arrived.wait()
        frames = list(self._frames)
        self._frames.clear()
        return frames
