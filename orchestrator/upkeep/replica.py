"""This replica's membership: heartbeats, and marking the runs of lost replicas interrupted.

Each replica heartbeats into Cassandra every ``heartbeat_interval_s`` (the first one before it takes
any work: a run whose owner never heartbeated could not be found as orphaned). Every replica also
looks for runs whose owner has been silent for ``orphan_after_s`` and ends them as INTERRUPTED: the
output checkpointed before the loss is kept as the stored (incomplete) assistant message with
finish_reason ERROR, the chat's active run is cleared, and streams attached anywhere get that output
and a final ``error`` event (code ABORTED) saying to regenerate. The conditional finish makes this
safe when several replicas reap at once, or when the owner was only paused and finishes after all.

Why interrupt instead of continuing the generation elsewhere: the router's stream died with the
owner (and with it the engine work), what a client saw after the last checkpoint is not stored, and a
continuation would have to re-prefill the whole prompt. An explicit "interrupted, regenerate" is
honest and cheap; failures of engines, the common case, are already hidden by the router's failover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from memory_store.models import FinishReason, RunOutcome, RunStatus
from memory_store.store import MemoryStore
from orchestrator.config import RunConfig
from orchestrator.metrics import METRICS
from orchestrator.runs.lifecycle import Runs
from orchestrator.runs.replay import INTERRUPTED_CODE, INTERRUPTED_MESSAGE

log = logging.getLogger(__name__)


class Replica:
    def __init__(self, replica_id: str, store: MemoryStore, runs: Runs, config: RunConfig) -> None:
        self.replica_id = replica_id
        self.store = store
        self.runs = runs
        self.config = config
        self._tasks: list[asyncio.Task[None]] = []

    async def join(self) -> None:
        """Heartbeats once (before taking work) and starts the periodic loops."""
        await self.store.heartbeat_replica(self.replica_id)
        self._tasks = [
            asyncio.create_task(
                self._every(self.config.heartbeat_interval_s, self._heartbeat), name="heartbeat"
            ),
            asyncio.create_task(self._every(self.config.reap_interval_s, self.reap), name="reaper"),
            asyncio.create_task(self._every(1.0, self._sweep), name="sweep"),
        ]

    async def leave(self) -> None:
        """Stops the loops and drops the heartbeat (called after the runs here have ended)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.store.forget_replica(self.replica_id)

    async def _every(self, period_s: float, work) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                async with asyncio.timeout(max(period_s, self.config.store_deadline_s)):
                    await work()
            except Exception as exc:
                log.warning("%s failed: %s", getattr(work, "__name__", "periodic work"), exc)

    async def _heartbeat(self) -> None:
        await self.store.heartbeat_replica(self.replica_id)

    async def _sweep(self) -> None:
        self.runs.sweep()

    async def reap(self) -> int:
        """Marks the in-progress runs of silent replicas interrupted; returns how many this replica ended."""
        orphans = await self.store.find_orphaned_runs(stale_after_s=self.config.orphan_after_s)
        reaped = 0
        for run in orphans:
            if run.owner_id == self.replica_id:
                continue  # our own heartbeat lagged; our runs are alive
            outcome = RunOutcome(
                status=RunStatus.INTERRUPTED,
                last_seq=run.last_seq,
                finish_reason=FinishReason.ERROR,
                error_code=INTERRUPTED_CODE,
                error_message=INTERRUPTED_MESSAGE,
            )
            ended = await self.store.finish_run(run, outcome)
            if ended.applied:
                reaped += 1
                METRICS.orphans_reaped.inc()
                log.warning(
                    "run %s of lost replica %s marked interrupted (%d events kept)",
                    run.run_id,
                    run.owner_id,
                    run.last_seq,
                )
        return reaped
