"""The adaptive stream interval (meshkit.pacing): nothing waits while the loop keeps up; under load a
stream's deltas gather for about twice the loop's lag, up to the bound, on one tick all streams share."""

from __future__ import annotations

import asyncio

import pytest

from meshkit.arrivals import Wakeup
from meshkit.event_loop import RecentLag
from meshkit.pacing import ENGAGE_LAG_S, GAIN, StreamPacer


def lagging(seconds: float) -> RecentLag:
    lag = RecentLag()
    lag.seconds = seconds
    return lag


@pytest.mark.parametrize(
    ("lag_s", "max_interval_s", "interval_s"),
    [
        (0.0, 0.1, 0.0),  # idle
        (ENGAGE_LAG_S / 2, 0.1, 0.0),  # keeping up: every delta alone
        (0.01, 0.1, GAIN * 0.01),  # late: about as long again as the loop already makes it wait
        (0.2, 0.1, 0.1),  # very late: the bound
        (0.2, 0.0, 0.0),  # turned off
    ],
)
def test_the_interval_follows_the_loops_lag(lag_s: float, max_interval_s: float, interval_s: float) -> None:
    assert StreamPacer(max_interval_s, lagging(lag_s)).interval_s == pytest.approx(interval_s)


def test_the_recent_lag_follows_the_samples_and_forgets_a_lone_late_timer() -> None:
    lag = RecentLag()
    lag.observe(0.1)
    assert 0 < lag.seconds < 0.05
    for _ in range(40):
        lag.observe(0.02)
    assert lag.seconds == pytest.approx(0.02, rel=0.01)
    for _ in range(40):
        lag.observe(0.0)
    assert lag.seconds < ENGAGE_LAG_S


async def test_streams_gathering_share_one_tick_an_interval_after_the_first() -> None:
    pacer = StreamPacer(0.1, lagging(0.02))  # 40 ms
    loop = asyncio.get_running_loop()
    began = loop.time()
    woke: list[float] = []

    async def gather(delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await pacer.gather(until=Wakeup())
        woke.append(loop.time() - began)

    await asyncio.gather(gather(0.0), gather(0.01), gather(0.02))
    assert len(woke) == 3 and max(woke) - min(woke) < 0.005  # the same tick
    assert 0.035 <= min(woke) < 0.08


async def test_a_gathering_stream_leaves_at_once_when_its_run_ends() -> None:
    pacer = StreamPacer(0.1, lagging(0.05))  # 100 ms
    ended, other = Wakeup(), Wakeup()
    waiting = asyncio.ensure_future(pacer.gather(until=ended))
    still = asyncio.ensure_future(pacer.gather(until=other))
    await asyncio.sleep(0.01)
    ended.notify()
    await asyncio.wait_for(waiting, 0.02)
    assert not still.done()  # the others wait for the tick
    await asyncio.wait_for(still, 0.2)
