"""This replica's membership: heartbeats, and adopting the runs of lost replicas.

Each replica heartbeats into Cassandra every ``heartbeat_interval_s`` (the first one before it takes
any work: a run whose owner never heartbeated could not be found as orphaned). Every replica also
looks for runs whose owner has been silent for ``orphan_after_s`` and adopts them (``Adoptions.adopt``):
one conditional write makes it the run's owner, and it continues the generation from the run's last
checkpoint with the run's stored request and seed, so clients resuming from their last sequence
number on any replica get the rest of the answer, and the stored answer is the streamed one. A run
that cannot be continued (stored before runs kept their request) is ended as INTERRUPTED with its
checkpointed output, as before. An owner that was only paused, not dead, finds its run adopted and
leaves it (``Stop.SUPERSEDED``): the adopter signals it, and its watch over its runs
(``runs/remote_ends.py``, a pass every SIGNAL_POLL_S) reads the run again and finds the new owner.
A run its lost owner had ended but not settled (it died after the finish, before the answer's writes
landed) is settled by the same pass: its answer, usage and chat state stored from its stored output.

Each replica also stores, every ``reap_interval_s``, the ends its runs could not store in time
(``runs/late_ends.py``): its own runs, which nobody else takes while it heartbeats. For the same
reason it looks, every half start lease, for its own runs that it does not have in hand (``reap_own``):
a start that failed after its run row landed (a write whose answer was lost, a start cancelled at
shutdown), an adoption whose give-back or interrupt write was lost. Once older than the start lease
(any start of theirs has ended by then), it continues them as it adopts a lost replica's runs (or
settles those that ended), so their questions are answered, keyed retries that joined them get the
answer, and their chats stop generating.

A replica shutting down hands its unfinished runs over: once their output is checkpointed, its last
heartbeat is dated to the epoch (``leave``), so the other replicas' next pass adopts them at once
rather than after ``orphan_after_s``. Late ends it still could not store, and runs its index still
holds (a start cut short by the shutdown whose row may have landed), are left the same way; only a
replica whose index holds nothing drops its heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime, timedelta

from prometheus_client import Counter

from memory_store.models import Run
from memory_store.store import MemoryStore
from orchestrator.config import RunConfig
from orchestrator.metrics import METRICS
from orchestrator.runs.late_ends import LateEnds
from orchestrator.runs.lifecycle import Runs
from orchestrator.runs.remote_ends import SIGNAL_POLL_S, RemoteEnds

log = logging.getLogger(__name__)

# The heartbeat of a replica that shut down leaving runs to adopt: older than any orphan_after_s.
GONE = datetime(2000, 1, 1, tzinfo=UTC)


class Membership:
    def __init__(
        self,
        replica_id: str,
        group: str,
        store: MemoryStore,
        runs: Runs,
        late_ends: LateEnds,
        config: RunConfig,
    ) -> None:
        self.replica_id = replica_id
        self.group = group
        self.store = store
        self.runs = runs
        self.late_ends = late_ends
        self.config = config
        self._tasks: list[asyncio.Task[None]] = []
        # Adoptions at once (each a conditional write and a read; the run's placement is its own task).
        self._adopting = asyncio.Semaphore(16)
        self.remote_ends = RemoteEnds(store, replica_id, runs.held.relays, config.store_deadline_s)

    async def join(self) -> None:
        """Heartbeats once (before taking work) and starts the periodic loops."""
        await self.store.heartbeat_replica(self.replica_id, group=self.group)
        self._tasks = [
            asyncio.create_task(
                self._every(self.config.heartbeat_interval_s, self._heartbeat), name="heartbeat"
            ),
            asyncio.create_task(self._every(self.config.reap_interval_s, self.reap), name="reaper"),
            asyncio.create_task(self._every(self.config.start_lease_s / 2, self.reap_own), name="own-reaper"),
            asyncio.create_task(
                self._every(self.config.reap_interval_s, self.late_ends.store_all), name="late-ends"
            ),
            asyncio.create_task(self._every(1.0, self._sweep), name="sweep"),
            asyncio.create_task(self._every(SIGNAL_POLL_S, self.remote_ends.poll), name="remote-ends"),
        ]

    async def leave(self, handed_over: int) -> None:
        """Stops the loops and says this replica is gone (called after its runs ended or were handed
        over): with runs handed over, late ends it still cannot store, or runs still in its index, its
        heartbeat is dated so that another replica takes them at its next pass (and forgets this one
        once none are left); otherwise the heartbeat is dropped. If Cassandra cannot tell, the
        heartbeat stays as it is: it goes stale, and the runs are adopted after ``orphan_after_s``."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            if (
                handed_over
                or await self.late_ends.store_all()
                or await self.store.find_owned_runs(self.replica_id)
            ):
                await self.store.heartbeat_replica(self.replica_id, at=GONE, group=self.group)
            else:
                await self.store.forget_replica(self.replica_id, self.group)

    async def _every(self, period_s: float, work) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                async with asyncio.timeout(max(period_s, self.config.store_deadline_s)):
                    await work()
            except Exception as exc:
                log.warning("%s failed: %s", getattr(work, "__name__", "periodic work"), exc)

    async def _heartbeat(self) -> None:
        await self.store.heartbeat_replica(self.replica_id, group=self.group)

    async def _sweep(self) -> None:
        self.runs.held.sweep()

    async def reap(self) -> int:
        """Adopts the in-progress runs of silent replicas (ending as interrupted those that cannot be
        continued), and settles the runs they ended without storing what the end leaves; returns how
        many runs this replica adopted."""
        found = await self.store.find_orphaned_runs(
            stale_after_s=self.config.orphan_after_s, group=self.group
        )
        # Our own heartbeat may have lagged: our runs are alive (those we do not hold: ``reap_own``).
        orphans = [run for run in found if run.owner_id != self.replica_id]
        return await self._take_up(orphans, METRICS.orphans_reaped, "adopted")

    async def reap_own(self) -> int:
        """Continues this replica's own runs that it does not have in hand once they are older than
        the start lease (and settles those that ended without what the end leaves stored); returns how
        many it continued."""
        found = await self.store.find_owned_runs(self.replica_id, skip=self.runs.held.holds)
        horizon = datetime.now(UTC) - timedelta(seconds=self.config.start_lease_s)
        strays = [run for run in found if run.created_at < horizon and not self.runs.held.holds(run.run_id)]
        for run in strays:
            log.warning(
                "run %s of this replica is not in hand here (%s): taking it up", run.run_id, run.status
            )
        return await self._take_up(strays, METRICS.strays_reaped, "continued")

    async def _take_up(self, runs: list[Run], counted: Counter, continued: str) -> int:
        """Continues here the runs in progress among ``runs`` and settles those that ended; returns
        how many it continued (counted as ``continued``)."""
        # Each adoption runs to its end even if this pass times out: a run made ours must go on here
        # (nobody else would take it now).
        adopted, _ = await asyncio.gather(
            asyncio.gather(
                *(
                    asyncio.shield(self._adopt(run, counted, continued))
                    for run in runs
                    if not run.status.terminal
                )
            ),
            asyncio.gather(*(self._settle(run, counted) for run in runs if run.status.terminal)),
        )
        return sum(adopted)

    async def _settle(self, run: Run, counted: Counter) -> None:
        """Stores the end of a run its owner ended (its answer, usage and chat state): the same writes
        whichever replica makes them, any number of times."""
        async with self._adopting:
            await self.store.settle_run(run)
        counted.labels("settled").inc()

    async def _adopt(self, run: Run, counted: Counter, continued: str) -> bool:
        async with self._adopting:
            adopted = await self.runs.adoptions.adopt(run, self.replica_id)
        if adopted:
            counted.labels(continued).inc()
        return adopted
