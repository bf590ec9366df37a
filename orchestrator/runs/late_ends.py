"""Run ends their relay could not store in time, stored later by the replica that ran them.

A relay retries storing its run's end for ``finish_retry_s`` (Cassandra unreachable all that while),
then ends its streams with UNAVAILABLE and leaves the end here: the end its clients were told, FAILED
with the whole output streamed. Until it is stored the run reads as in progress in Cassandra, the chat
names it as its active run, and no other replica takes it (its owner still heartbeats). So the owner
goes on trying, each pass of its membership's loops (``Membership``), until the end lands: the answer
streamed is then the chat's message, as a finish that took at once would have stored it (``finish_run``
is idempotent, and if an attempt that timed out did land, its verdict stands and only what follows it
is written).

A pass stops at its first failure: while Cassandra is down one attempt a pass is enough to find out.
A run another replica owns by now (it took this one for dead while Cassandra could not hear its
heartbeat) is that replica's to end, and is dropped here. A replica that shuts down with ends still
here leaves them as it leaves runs it hands over (``Membership.leave``): its heartbeat is dated so that
another replica's reaper settles them, or adopts a run whose end never landed and regenerates the same
answer. The ends live in memory only: a replica killed with some leaves their runs to the reaper too
(its heartbeat goes stale), which regenerates them to COMPLETED though their streams were told FAILED.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from memory_store.errors import OwnerChanged, Unavailable
from memory_store.models import Run, RunDelta, RunOutcome
from memory_store.store import MemoryStore
from orchestrator.metrics import METRICS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LateEnd:
    run: Run
    outcome: RunOutcome
    output: list[RunDelta]


class LateEnds:
    def __init__(self, store: MemoryStore, deadline_s: float) -> None:
        self.store = store
        self.deadline_s = deadline_s
        self._ends: dict[str, LateEnd] = {}

    def add(self, run: Run, outcome: RunOutcome, output: list[RunDelta]) -> None:
        self._ends[run.run_id] = LateEnd(run, outcome, output)
        METRICS.late_ends.set(len(self._ends))
        log.warning("run %s: its end is stored once the store answers again", run.run_id)

    def holds(self, run_id: str) -> bool:
        """Whether the run's end waits here to be stored."""
        return run_id in self._ends

    async def store_all(self) -> int:
        """Tries to store each end waiting, oldest first, until one fails for want of Cassandra;
        returns how many are still waiting."""
        try:
            for run_id, end in list(self._ends.items()):
                try:
                    async with asyncio.timeout(self.deadline_s):
                        await self.store.finish_run(end.run, end.outcome, end.output)
                except (TimeoutError, Unavailable):
                    break
                except OwnerChanged:
                    log.info("run %s is owned by another replica now: its end is theirs", run_id)
                    outcome = "taken_over"
                except Exception as exc:
                    log.error("run %s: its end cannot be stored: %s", run_id, exc, exc_info=exc)
                    outcome = "dropped"
                else:
                    log.info("run %s: its end is stored", run_id)
                    outcome = "stored"
                del self._ends[run_id]
                METRICS.late_ends_done.labels(outcome).inc()
        finally:
            METRICS.late_ends.set(len(self._ends))
        return len(self._ends)
