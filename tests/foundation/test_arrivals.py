"""meshkit.arrivals: a ``Wakeup`` wakes every task waiting on it at its next notify. (``Arrivals``, a
request's feed on a link, is tested through the link: tests/foundation/test_links.py.)"""

from __future__ import annotations

import asyncio
import contextlib

from meshkit.arrivals import Wakeup


async def test_a_wakeup_wakes_every_waiter_at_its_next_notify_and_forgets_a_cancelled_one():
    wakeup = Wakeup()
    wakeup.notify()  # nobody waits: nothing is remembered
    woken: list[str] = []

    async def waiter(name: str) -> None:
        await wakeup.wait()
        woken.append(name)

    first, second, cancelled = (asyncio.create_task(waiter(n)) for n in ("first", "second", "cancelled"))
    await asyncio.sleep(0)
    assert woken == []
    cancelled.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cancelled
    wakeup.notify()
    await asyncio.gather(first, second)
    assert sorted(woken) == ["first", "second"]
    late = asyncio.create_task(waiter("late"))
    await asyncio.sleep(0.01)
    assert not late.done(), "a wait begun after a notify waits for the next one"
    wakeup.notify()
    await late
