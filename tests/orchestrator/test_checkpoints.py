"""The replica's checkpoint writer (pure logic: a store that records what it was asked to write). The
writes themselves, on a real Cassandra node: tests/memory_store/test_runs.py (checkpoint_runs); a run's
checkpoints read back by another replica and by an adopter: tests/orchestrator/test_runs.py and
test_replica_loss.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from memory_store.models import Run, RunDelta
from orchestrator.runs.checkpoints import MAX_BATCH_BYTES, CheckpointWriter, first_batch
from tests.fixtures.runs import stored_run

INTERVAL_S = 0.05


def delta(seq: int) -> RunDelta:
    return RunDelta(seq, f"t{seq}", 1, (seq,))


class Store:
    """Records each checkpoint_runs call as {run id: seqs}; fails the runs in ``failing``; a write waits
    for ``gate`` when it is set."""

    def __init__(self) -> None:
        self.calls: list[dict[str, list[int]]] = []
        self.failing: set[str] = set()
        self.gate: asyncio.Event | None = None
        self._called = asyncio.Condition()

    async def checkpoint_runs(self, writes: Sequence[tuple[Run, Sequence[RunDelta]]]) -> list[bool]:
        async with self._called:
            self.calls.append({r.run_id: [d.seq for d in deltas] for r, deltas in writes})
            self._called.notify_all()
        if self.gate is not None:
            await self.gate.wait()
        return [r.run_id not in self.failing for r, _ in writes]

    async def until(self, holds: Callable[[], bool]) -> None:
        """Waits (10 s at most) until the calls so far make ``holds`` true."""
        async with asyncio.timeout(10.0), self._called:
            await self._called.wait_for(holds)


def writer(store: Store, every_events: int = 32) -> CheckpointWriter:
    return CheckpointWriter(store, every_events, INTERVAL_S, deadline_s=1.0)


async def test_every_runs_new_deltas_go_in_one_call_each_interval_in_order() -> None:
    store = Store()
    checkpoints = writer(store)
    runs = [checkpoints.open(stored_run(f"run-{i}")) for i in range(3)]
    for seq in range(2, 5):
        for each in runs:
            each.add(delta(seq))
    await store.until(lambda: len(store.calls) == 1)
    assert store.calls == [{f"run-{i}": [2, 3, 4] for i in range(3)}]
    runs[1].add(delta(5))
    await store.until(lambda: len(store.calls) == 2)
    assert store.calls[1:] == [{"run-1": [5]}]
    assert [await each.close() for each in runs] == [[], [], []]
    await checkpoints.close()


async def test_a_run_with_every_events_waiting_is_written_at_once() -> None:
    store = Store()
    checkpoints = CheckpointWriter(store, 3, interval_s=60.0, deadline_s=1.0)
    busy, quiet = checkpoints.open(stored_run("busy")), checkpoints.open(stored_run("quiet"))
    quiet.add(delta(2))
    for seq in range(2, 5):
        busy.add(delta(seq))
    await store.until(lambda: len(store.calls) == 1)
    assert store.calls == [{"busy": [2, 3, 4]}]  # the quiet one waits for the interval
    assert await quiet.close() == [delta(2)]  # what the run's finish stores as its tail
    await checkpoints.close()


async def test_a_failed_write_keeps_its_deltas_for_the_next_pass() -> None:
    store = Store()
    store.failing = {"run-1"}
    checkpoints = writer(store)
    flaky = checkpoints.open(stored_run("run-1"))
    flaky.add(delta(2))
    await store.until(lambda: len(store.calls) == 1)
    store.failing = set()
    flaky.add(delta(3))
    await store.until(lambda: {"run-1": [2, 3]} in store.calls)
    assert store.calls[0] == {"run-1": [2]}
    assert await flaky.close() == []
    await checkpoints.close()


async def test_close_waits_for_a_write_in_flight_and_returns_only_what_it_did_not_store() -> None:
    store = Store()
    store.gate = asyncio.Event()
    checkpoints = writer(store)
    answer = checkpoints.open(stored_run("run-1"))
    answer.add(delta(2))
    await store.until(lambda: len(store.calls) == 1)  # the pass is in flight, held at the gate
    answer.add(delta(3))
    closing = asyncio.create_task(answer.close())
    await asyncio.sleep(0.01)
    assert not closing.done()
    store.gate.set()
    assert await closing == [delta(3)]
    await asyncio.sleep(INTERVAL_S * 2)
    assert store.calls == [{"run-1": [2]}]  # a closed run is not written again
    await checkpoints.close()


async def test_a_run_handed_over_stores_what_is_left_before_it_goes() -> None:
    store = Store()
    checkpoints = CheckpointWriter(store, 32, interval_s=60.0, deadline_s=1.0)
    answer = checkpoints.open(stored_run("run-1"))
    for seq in range(2, 6):
        answer.add(delta(seq))
    assert await answer.close(flush_within_s=1.0) == []
    assert store.calls == [{"run-1": [2, 3, 4, 5]}]
    await checkpoints.close()


async def test_logprobs_heavy_deltas_go_in_writes_of_at_most_max_batch_bytes_a_long_backlog_no_tail() -> None:
    store = Store()
    checkpoints = CheckpointWriter(store, 10_000, interval_s=60.0, deadline_s=1.0)
    answer = checkpoints.open(stored_run("run-1"))
    # 20 alternatives a token: ~0.5 KiB each; 600 of them are more than one write holds.
    heavy = [RunDelta(seq, "", 1, (seq,), logprobs=b"x" * 500) for seq in range(2, 602)]
    for each in heavy:
        answer.add(each)
    per_write = len(first_batch(heavy))
    assert per_write * 500 <= MAX_BATCH_BYTES < (per_write + 1) * 500
    assert answer.too_long_for_a_tail()
    assert await answer.close(flush_within_s=1.0) == []
    assert [len(call["run-1"]) for call in store.calls] == [per_write, per_write, 600 - 2 * per_write]
    # One delta is written whatever its size, and a short backlog is a tail.
    huge = RunDelta(2, "", 1, (2,), logprobs=b"x" * (MAX_BATCH_BYTES + 1))
    assert first_batch([huge, heavy[1]]) == [huge]
    assert not checkpoints.open(stored_run("run-2")).too_long_for_a_tail()
    await checkpoints.close()
