"""How the owner of a stored run learns that another replica ended it (CancelRun there) or adopted it
(this replica was taken for dead: a long pause, a partition), so that it stops the engine work at once.

The replica that ends or adopts another's run signals the owner (``MemoryStore.signal_owner``: a row in
the owner's partition of those ten seconds). Every SIGNAL_POLL_S the owner reads its partitions since
its last read and reads again the runs named there that it still generates: a Cassandra read or
three a replica every two seconds, however many runs it holds. Reading each run's state every two
seconds instead cost a read per run: 5,000 a second for a replica holding 10,000 streams, whatever
happened to them.

A signal can be lost (its writer died after ending the run), so every run is also read once every
SWEEP_S; and after a gap in the owner's reads longer than READ_GAP_S (a pause, Cassandra
unreachable), every run is read at once rather than the gap's partitions. Signals are dated by their
writer's clock: the owner reads CLOCK_SKEW_S more on either side of its window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta

from memory_store.errors import MemoryStoreError
from memory_store.models import Run
from memory_store.store import MemoryStore
from orchestrator.runs.relay import Relay
from orchestrator.runs.run_state import Stop

log = logging.getLogger(__name__)

SIGNAL_POLL_S = 2.0
# Every run this replica generates is read at least this often, signalled or not.
SWEEP_S = 60.0
# A longer gap between two reads of the signals: every run is read instead.
READ_GAP_S = 60.0
# How far apart the replicas' clocks may be for a signal to be read in its owner's next pass.
CLOCK_SKEW_S = 10.0
# Runs read at once.
READS_AT_ONCE = 16


class RemoteEnds:
    """One replica's watch over the stored runs it generates; ``poll`` is one pass (every
    SIGNAL_POLL_S: ``Membership``)."""

    def __init__(
        self,
        store: MemoryStore,
        owner_id: str,
        relays: Callable[[], Iterable[Relay]],
        deadline_s: float,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``relays``: the runs this replica relays now; ``deadline_s``: of each Cassandra read; ``clock``
        dates the signals' window, ``monotonic`` the sweep."""
        self.store = store
        self.owner_id = owner_id
        self.relays = relays
        self.deadline_s = deadline_s
        self.clock = clock
        self.monotonic = monotonic
        # When the signals were last read (this replica's clock): the next pass reads from there.
        self._read_until = clock()
        # When each run was last read (monotonic), for the sweep.
        self._read_at: dict[str, float] = {}
        self._reads = asyncio.Semaphore(READS_AT_ONCE)

    async def poll(self) -> None:
        """Reads the signalled runs, and those due for the sweep, and stops those ended or adopted
        elsewhere."""
        watched = {
            relay.live.info.run_id: relay
            for relay in self.relays()
            if relay.stored_run is not None and relay.stop_reason is None
        }
        now = self.monotonic()
        self._read_at = {run_id: self._read_at.get(run_id, now) for run_id in watched}
        due = {run_id for run_id, read_at in self._read_at.items() if now - read_at >= SWEEP_S}
        signalled = await self._signalled()
        due |= watched.keys() if signalled is None else signalled & watched.keys()
        await asyncio.gather(*(self._read(watched[run_id]) for run_id in due))

    async def _signalled(self) -> set[str] | None:
        """The runs signalled since the last pass (None: every run must be read, the gap was too long).
        A read that fails leaves its window to the next pass."""
        until = self.clock()
        if until - self._read_until > timedelta(seconds=READ_GAP_S):
            log.warning("signals not read for %s; reading every run", until - self._read_until)
            self._read_until = until
            return None
        skew = timedelta(seconds=CLOCK_SKEW_S)
        try:
            async with asyncio.timeout(self.deadline_s):
                signalled = await self.store.signalled_runs(
                    self.owner_id, self._read_until - skew, until + skew
                )
        except (MemoryStoreError, TimeoutError) as exc:
            log.warning("could not read the runs signalled to this replica: %s", exc)
            return set()
        self._read_until = until
        return signalled

    async def _read(self, relay: Relay) -> None:
        """Stops ``relay``'s run if its stored state says it ended, or has another owner."""
        assert relay.stored_run is not None
        info = relay.live.info
        with contextlib.suppress(MemoryStoreError, TimeoutError):
            async with self._reads, asyncio.timeout(self.deadline_s):
                run = await self.store.get_run(info.user_id, info.run_id)
            self._read_at[info.run_id] = self.monotonic()
            if run.status.terminal:
                relay.stop(Stop.CANCELLED)
            elif run.owner_id != relay.stored_run.owner_id:
                relay.stop(Stop.SUPERSEDED)


async def signal_owner(store: MemoryStore, run: Run, deadline_s: float) -> None:
    """Tells ``run``'s owner that this replica ended or adopted it. A signal lost here costs the
    owner's engine work until its next sweep reads the run (a minute at most), nothing more: the
    run's stored state is what counts."""
    try:
        async with asyncio.timeout(deadline_s):
            await store.signal_owner(run)
    except (MemoryStoreError, TimeoutError) as exc:
        log.warning("could not signal replica %s about run %s: %s", run.owner_id, run.run_id, exc)
