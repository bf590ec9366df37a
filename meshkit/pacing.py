"""A stream interval that adapts to load: while a process keeps up, each stream's deltas leave one by
one, as they are made; once its event loop runs late, a stream's deltas gather for a while and leave
as one event, on a tick every such stream shares.

Why: past the relay's own work, each event costs every hop after it the same whatever it carries (the
link frame, the edge's SSE event and its write, Envoy's pass, the client's read), so merged deltas are
what a saturated door can give up to serve more tokens (docs/benchmarks/front_door.md, "Streams that gather under load").
vLLM's ``--stream-interval`` merges N tokens always; here nothing waits while the loop keeps up, and
under load a delta waits a small multiple of what the loop already makes everything wait.

    interval = 0                                  while the loop's recent lag < ENGAGE_LAG_S
             = min(max_interval_s, GAIN x lag)   once it is later than that

The lag is ``meshkit.event_loop.RECENT_LAG`` (about the last two seconds of the loop's timer lateness).
Merging lowers the load, which lowers the lag and so the interval: the interval settles where the
process just keeps up with what it is asked.

A stream's first delta never waits (a follower that was idle sends what arrives at once), and nothing
waits for a stream's end once its run has ended (``gather``'s ``until``). All the streams gathering
share one tick, so their events leave in the same loop turn: on a link (``meshkit.links``), in one
message.
"""

from __future__ import annotations

import asyncio

from meshkit.arrivals import Wakeup
from meshkit.event_loop import RECENT_LAG, RecentLag

# Below this recent lag the loop keeps up: nothing waits.
ENGAGE_LAG_S = 0.002
# Past it, a stream's deltas gather for this many times the lag.
GAIN = 2.0


class StreamPacer:
    def __init__(self, max_interval_s: float, lag: RecentLag = RECENT_LAG) -> None:
        """``max_interval_s``: the longest a stream's deltas gather (0: never; every delta alone)."""
        self.max_interval_s = max(0.0, max_interval_s)
        self._lag = lag
        self._tick = Wakeup()
        self._tick_due: asyncio.TimerHandle | None = None

    @property
    def interval_s(self) -> float:
        """How long a stream's deltas gather now (0: they leave one by one)."""
        lag = self._lag.seconds
        if not self.max_interval_s or lag < ENGAGE_LAG_S:
            return 0.0
        return min(self.max_interval_s, GAIN * lag)

    async def gather(self, until: Wakeup) -> None:
        """Waits for the next tick (the first waiter sets it ``interval_s`` away), or for ``until``."""
        if self._tick_due is None:
            loop = asyncio.get_running_loop()
            self._tick_due = loop.call_later(self.interval_s, self._ticked)
        await self._tick.wait_or(until)

    def _ticked(self) -> None:
        self._tick_due = None
        self._tick.notify()
