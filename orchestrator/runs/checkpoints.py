"""Checkpoints of the running answers' partial output in Cassandra, written behind the streams.

One writer per replica (``CheckpointWriter``) stores every run's new deltas every ``interval_s``, and
a run's at once when ``every_events`` of them wait, all the runs of a pass in as few requests as the
store makes of them (``MemoryStore.checkpoint_runs``: unlogged batches of the runs the same nodes
hold). One pass at a time, so each run's deltas land in order, and the relay never waits for
Cassandra. A failed write keeps its deltas for the next pass. What is not written when a run ends is
handed to ``finish_run`` as its tail, so the stored answer is always complete; a run handed to another
replica is stored first (``RunCheckpoints.close``). If the replica dies, the output up to the last
checkpoint survives for the replica that adopts the run.

One writer rather than a task per run: a task of its own per run woke on a timer of its own and sent a
request of its own, and the driver's cost per request made a checkpoint ~270 µs of the orchestrator's
CPU (a profile at 1,000 answers of one token a second: 45 % of its event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from chatmesh.chat.v1 import chat_pb2
from memory_store.models import Run, RunDelta
from memory_store.store import MemoryStore
from orchestrator.metrics import METRICS

log = logging.getLogger(__name__)

# One write holds at most this many deltas of a run, and about this many bytes of their text and logprobs
# (memory_store allows 4096 events / 256 KiB; one token's logprobs with 20 alternatives take ~0.5 KiB).
MAX_BATCH = 512
MAX_BATCH_BYTES = 128 * 1024
# Between attempts to store what a run hands over.
FLUSH_RETRY_S = 0.2


def encoded_logprobs(logprobs: Sequence[chat_pb2.TokenLogprob]) -> bytes:
    """A delta's logprobs as they are checkpointed (``RunDelta.logprobs``): a Delta holding only them."""
    return chat_pb2.Delta(logprobs=logprobs).SerializeToString() if logprobs else b""


def decoded_logprobs(stored: bytes) -> Sequence[chat_pb2.TokenLogprob]:
    """The logprobs ``encoded_logprobs`` stored (none for b"")."""
    return chat_pb2.Delta.FromString(stored).logprobs if stored else ()


def first_batch(deltas: Sequence[RunDelta]) -> Sequence[RunDelta]:
    """The oldest of ``deltas`` that one write stores: ``MAX_BATCH`` at most, and no more than
    ``MAX_BATCH_BYTES`` of text, steps and logprobs beyond the first."""
    size = 0
    for count, delta in enumerate(deltas[:MAX_BATCH]):
        size += len(delta.text) + len(delta.step) + len(delta.logprobs)
        if size > MAX_BATCH_BYTES and count:
            return deltas[:count]
    return deltas[:MAX_BATCH]


class RunCheckpoints:
    """One run's deltas not stored yet (``CheckpointWriter.open``)."""

    def __init__(self, writer: CheckpointWriter, run: Run) -> None:
        self.run = run
        self.pending: list[RunDelta] = []
        self._writer = writer

    def add(self, delta: RunDelta) -> None:
        self.pending.append(delta)
        if len(self.pending) == self._writer.every_events:
            self._writer.wake()

    async def store_now(self, within_s: float) -> bool:
        """Stores every pending delta now, in order, retrying for ``within_s``: whether all landed. A tool
        step is stored so before its tool runs (docs/tools.md). The writer's passes leave the run alone
        meanwhile (after one writing it lands), so no delta is written by both."""
        await self._writer.forget(self)
        try:
            deadline = time.monotonic() + within_s
            while self.pending:
                if time.monotonic() >= deadline:
                    return False
                if not await self._writer.write([self]):
                    await asyncio.sleep(FLUSH_RETRY_S)
            return True
        finally:
            self._writer.resume(self)

    async def close(self, flush_within_s: float = 0.0) -> list[RunDelta]:
        """Stops writing the run (after a write of it in flight lands) and returns the deltas not yet
        stored. With ``flush_within_s``, it first stores them, retrying for that long (a run handed to
        another replica, which continues from the last checkpoint, or a backlog longer than the end's one
        row of tail holds: ``too_long_for_a_tail``)."""
        await self._writer.forget(self)
        deadline = time.monotonic() + flush_within_s
        while self.pending and time.monotonic() < deadline:
            if not await self._writer.write([self]):
                await asyncio.sleep(FLUSH_RETRY_S)
        return self.pending

    def too_long_for_a_tail(self) -> bool:
        """Whether the deltas not yet stored are more than one write holds (the end's tail is one row)."""
        return len(first_batch(self.pending)) < len(self.pending)


class CheckpointWriter:
    def __init__(self, store: MemoryStore, every_events: int, interval_s: float, deadline_s: float) -> None:
        self.store = store
        self.every_events = max(1, every_events)
        self.interval_s = interval_s
        self.deadline_s = deadline_s
        self._runs: set[RunCheckpoints] = set()
        self._wake = asyncio.Event()
        # The runs of the pass in flight, and when it has landed.
        self._writing: set[RunCheckpoints] = set()
        self._written: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def open(self, run: Run) -> RunCheckpoints:
        """Starts checkpointing ``run``: add its deltas to what this returns, and close it at the end."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="checkpoints")
        checkpoints = RunCheckpoints(self, run)
        self._runs.add(checkpoints)
        return checkpoints

    def wake(self) -> None:
        self._wake.set()

    def resume(self, checkpoints: RunCheckpoints) -> None:
        """Writes a run again that ``forget`` left (``RunCheckpoints.store_now``)."""
        self._runs.add(checkpoints)

    async def forget(self, checkpoints: RunCheckpoints) -> None:
        """Writes no more of a run, once a pass writing it has landed."""
        self._runs.discard(checkpoints)
        if checkpoints in self._writing and self._written is not None:
            await self._written.wait()

    async def close(self) -> None:
        """Stops the passes (the replica shuts down: its runs were closed, or handed over)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        next_tick = time.monotonic() + self.interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_tick - time.monotonic())):
                    await self._wake.wait()
            self._wake.clear()
            ticked = time.monotonic() >= next_tick
            if ticked:
                next_tick = time.monotonic() + self.interval_s
            due = [c for c in self._runs if c.pending and (ticked or len(c.pending) >= self.every_events)]
            if due:
                try:
                    await self._pass(due)
                except Exception:  # the passes must go on: a run's deltas stay pending
                    log.exception("a checkpoint pass failed")

    async def _pass(self, due: list[RunCheckpoints]) -> None:
        self._writing, self._written = set(due), asyncio.Event()
        try:
            await self.write(due)
        finally:
            self._written.set()
            self._writing = set()

    async def write(self, runs: list[RunCheckpoints]) -> bool:
        """Stores the oldest pending deltas of each of ``runs`` (a request per batch the store makes of
        them); a run whose write failed keeps them for the next. Returns whether all were stored."""
        writes = [(c.run, first_batch(c.pending)) for c in runs]
        try:
            async with asyncio.timeout(self.deadline_s):
                stored = await self.store.checkpoint_runs(writes)
        except Exception as exc:
            log.warning("checkpoints of %d runs failed: %s", len(runs), exc)
            stored = [False] * len(runs)
        for checkpoints, (_, deltas), ok in zip(runs, writes, stored, strict=True):
            if ok:
                del checkpoints.pending[: len(deltas)]
        written = sum(stored)
        METRICS.checkpoints.labels("written").inc(written)
        if written < len(runs):
            METRICS.checkpoints.labels("failed").inc(len(runs) - written)
        return written == len(runs)
