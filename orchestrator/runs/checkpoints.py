"""Checkpoints of a run's partial output in Cassandra, written behind the stream.

Deltas are written every ``every_events`` events or ``interval_s`` seconds, whichever comes first, one
write at a time and in order, by a task of their own: the relay never waits for Cassandra. A failed
write keeps its deltas for the next one. What is not written when the run ends is handed to
``finish_run`` as its tail, so the stored answer is always complete. If the replica dies, the output
up to the last checkpoint survives for the replica that marks the run interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from memory_store.models import Run, RunDelta
from memory_store.store import MemoryStore
from orchestrator.metrics import METRICS

log = logging.getLogger(__name__)

# One write holds at most this many deltas (memory_store allows 4096 events / 256 KiB per checkpoint).
MAX_BATCH = 512
# Between attempts to store what a run hands over.
FLUSH_RETRY_S = 0.2


class Checkpointer:
    def __init__(
        self, store: MemoryStore, run: Run, every_events: int, interval_s: float, deadline_s: float
    ) -> None:
        self._store = store
        self._run = run
        self._every = max(1, every_events)
        self._interval_s = interval_s
        self._deadline_s = deadline_s
        self._pending: list[RunDelta] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._task = asyncio.create_task(self._loop(), name=f"checkpoints-{run.run_id}")

    def add(self, delta: RunDelta) -> None:
        self._pending.append(delta)
        if len(self._pending) >= self._every:
            self._wake.set()

    async def close(self, flush_within_s: float = 0.0) -> list[RunDelta]:
        """Stops writing (after a write in flight lands) and returns the deltas not yet stored. With
        ``flush_within_s``, it first stores them, retrying for that long (a run handed to another
        replica, which continues from the last checkpoint)."""
        self._closing = True
        self._wake.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        deadline = time.monotonic() + flush_within_s
        while self._pending and time.monotonic() < deadline:
            if not await self._write():
                await asyncio.sleep(FLUSH_RETRY_S)
        return self._pending

    async def _loop(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._wake.wait()
            self._wake.clear()
            if not self._closing and self._pending:
                await self._write()

    async def _write(self) -> bool:
        """Stores the oldest pending deltas (one batch); on failure they stay pending for the next write
        (or the finish, which carries them)."""
        batch = self._pending[:MAX_BATCH]
        try:
            async with asyncio.timeout(self._deadline_s):
                await self._store.checkpoint_run(self._run, batch)
        except Exception as exc:
            METRICS.checkpoints.labels("failed").inc()
            log.warning("checkpoint of run %s failed: %s", self._run.run_id, exc)
            return False
        METRICS.checkpoints.labels("written").inc()
        del self._pending[: len(batch)]
        return True
