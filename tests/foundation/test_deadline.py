"""meshkit.deadline: one timer for a stream's waits, which cuts a wait and never the work between."""

from __future__ import annotations

import asyncio

import pytest

from meshkit.deadline import Deadline


async def _events(queue: asyncio.Queue[int]):
    while True:
        yield await queue.get()


async def test_a_wait_past_the_deadline_raises_timeout_and_leaves_the_task_uncancelled() -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[int] = asyncio.Queue()
    events = _events(queue)
    with Deadline(loop.time() + 0.05) as deadline:
        queue.put_nowait(1)
        assert await deadline.wait(anext(events)) == 1
        with pytest.raises(TimeoutError):
            await deadline.wait(anext(events))  # nothing comes: the timer cuts this wait
        with pytest.raises(TimeoutError):
            await deadline.wait(asyncio.sleep(0))  # passed: every later wait fails at once
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # no cancel is left pending on the task


async def test_the_timer_firing_between_waits_cancels_nothing() -> None:
    """A stream writes what it got between waits: the deadline passing then must not cut the write."""
    loop = asyncio.get_running_loop()
    with Deadline(loop.time() + 0.02) as deadline:
        assert await deadline.wait(asyncio.sleep(0, "event")) == "event"
        await asyncio.sleep(0.06)  # "the write": outlives the deadline, and is not cancelled
        with pytest.raises(TimeoutError):
            await deadline.wait(asyncio.sleep(0))


async def test_no_deadline_never_times_out_and_a_later_one_applies() -> None:
    loop = asyncio.get_running_loop()
    with Deadline() as deadline:
        assert await deadline.wait(asyncio.sleep(0.03, "slow")) == "slow"
        deadline.reschedule(loop.time() + 0.02)  # a drain begins
        with pytest.raises(TimeoutError):
            await deadline.wait(asyncio.sleep(1))


async def test_moving_the_deadline_later_each_wait_is_an_idle_timeout() -> None:
    loop = asyncio.get_running_loop()
    with Deadline() as deadline:
        began = loop.time()
        for _ in range(6):  # 6 x 30 ms of waits, each well inside a 60 ms idle window
            deadline.reschedule(loop.time() + 0.06)
            await deadline.wait(asyncio.sleep(0.03))
        assert loop.time() - began >= 0.18
        deadline.reschedule(loop.time() + 0.06)
        with pytest.raises(TimeoutError):
            await deadline.wait(asyncio.sleep(1))
        assert loop.time() - began < 0.18 + 0.5


async def test_moving_the_deadline_earlier_rearms_it() -> None:
    loop = asyncio.get_running_loop()
    with Deadline(loop.time() + 10) as deadline:
        began = loop.time()
        deadline.reschedule(began + 0.02)
        with pytest.raises(TimeoutError):
            await deadline.wait(asyncio.sleep(1))
        assert loop.time() - began < 0.5


async def test_a_cancel_from_outside_stays_a_cancel() -> None:
    loop = asyncio.get_running_loop()
    waiting = asyncio.Event()

    async def stream() -> None:
        with Deadline(loop.time() + 0.05) as deadline:
            waiting.set()
            await deadline.wait(asyncio.sleep(1))

    task = asyncio.create_task(stream())
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancel_from_outside_at_the_deadline_wins() -> None:
    """Both at once (the client went as the deadline passed): the task's own cancel is not swallowed."""
    loop = asyncio.get_running_loop()
    deadline_box: list[Deadline] = []

    async def stream() -> None:
        with Deadline(loop.time() + 10) as deadline:
            deadline_box.append(deadline)
            await deadline.wait(asyncio.sleep(1))

    task = asyncio.create_task(stream())
    await asyncio.sleep(0.01)
    at = loop.time() + 0.01
    deadline_box[0].reschedule(at)  # the timer fires and cancels the wait ...
    loop.call_at(at, task.cancel)  # ... and so does the task's owner, before the task runs again
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_closed_deadline_fires_no_more() -> None:
    loop = asyncio.get_running_loop()
    deadline = Deadline(loop.time() + 0.01)
    deadline.close()
    await asyncio.sleep(0.03)
    assert await deadline.wait(asyncio.sleep(0, "still waits")) == "still waits"
