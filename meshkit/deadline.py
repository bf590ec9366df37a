"""A deadline for the many waits of one stream, with one timer for all of them.

A relay waits once per event for the next one, and each wait must end at the call's deadline (or at a
drain's). ``asyncio.timeout`` around each wait costs an object, a timer armed and cancelled, and on
Python 3.11 a system call: entering it asks for the current task, which asks for the running loop,
which asks the kernel for the process id. py-spy found that at ~12 % of the orchestrator's main thread
holding 3,000 streams. A ``Deadline`` arms one timer for the stream, and a wait only marks itself
waiting: when the timer fires during a wait, that wait is cancelled and raises ``TimeoutError``; a
timer that fires between waits (while the stream writes what it got) cancels nothing, and the next
wait raises at once. A write to the caller is never cut in half.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

# A timer may fire this much before its time (uvloop's timers count whole milliseconds).
_EARLY_S = 0.001


class Deadline:
    """The deadline of the task that makes it (``when`` on the loop's clock; None: none yet). Only
    that task may ``wait`` on it; ``close`` it when the stream ends (or use it as a context manager)."""

    def __init__(self, when: float | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Deadline belongs to a task")
        self._task = task
        self._timer: asyncio.TimerHandle | None = None
        self._when: float | None = None
        self._waiting = False
        self._expired = False
        self._cancelled_wait = False
        self.reschedule(when)

    def reschedule(self, when: float | None) -> None:
        """Moves the deadline to ``when`` (None: no deadline). A deadline that passed stays passed.

        Moving it later keeps the armed timer, which re-arms itself for the rest when it fires: an idle
        timeout pushed back at every event costs no timer per event."""
        self._when = when
        if self._expired:
            return
        if when is None or (self._timer is not None and when < self._timer.when()):
            self.close()
        if when is not None and self._timer is None:
            self._timer = self._loop.call_at(when, self._expire)

    def reschedule_in(self, delay_s: float) -> None:
        """``reschedule`` to ``delay_s`` from now."""
        self.reschedule(self._loop.time() + delay_s)

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """``await awaitable``, or TimeoutError once the deadline passes (at once if it has)."""
        if self._expired:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never awaited: say so to nobody
            raise TimeoutError
        self._waiting = True
        try:
            result = await awaitable
        except asyncio.CancelledError:
            if self._withdraw_cancel():
                raise TimeoutError from None
            raise
        finally:
            self._waiting = False
        # The timer fired as the wait was ending and the awaitable returned anyway: keep its result,
        # forget the cancel (the next wait raises).
        self._withdraw_cancel()
        return result

    def close(self) -> None:
        """Disarms the timer (the stream ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __enter__(self) -> Deadline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _withdraw_cancel(self) -> bool:
        """Takes back the timer's cancel of the task, if it made one; True if no other remains (the
        cancel was only the deadline's, not the task's own from outside, which must go on)."""
        if not self._cancelled_wait:
            return False
        self._cancelled_wait = False
        return self._task.uncancel() == 0

    def _expire(self) -> None:
        self._timer = None
        if self._when is None:
            return
        if self._when > self._loop.time() + _EARLY_S:  # moved later since the timer was armed
            self._timer = self._loop.call_at(self._when, self._expire)
            return
        self._expired = True
        if self._waiting:
            self._cancelled_wait = True
            self._task.cancel()
