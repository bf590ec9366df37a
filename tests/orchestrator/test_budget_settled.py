"""The budget's window read for a user of many runs (orchestrator/policy/admission.py): the sum of the
runs old enough to no longer change is kept, and only the runs made since are read, with the same total
as a read of the whole window. On a real Cassandra node."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

from memory_store.ids import new_id
from memory_store.models import Usage, UsageWindow
from memory_store.store import MemoryStore
from orchestrator.config import BudgetConfig
from orchestrator.policy import admission
from orchestrator.policy.admission import Budgets

SETTLED_AFTER_S = 2.0
RUN = Usage(prompt_tokens=10, cached_prompt_tokens=0, completion_tokens=5)


class ReadsSeen:
    """The store, recording each window read's bounds and how many runs it counted."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.reads: list[tuple[datetime | None, datetime | None, int]] = []
        # Added to the window's start as Budgets sees it: a window that has turned.
        self.turned = timedelta(0)

    def window_start(self, at: datetime) -> datetime:
        return self._store.window_start(at) + self.turned

    async def get_usage(
        self, user_id: str, at: datetime | None = None, **bounds: datetime | None
    ) -> UsageWindow:
        window = await self._store.get_usage(user_id, at, **bounds)
        self.reads.append((bounds.get("made_after"), bounds.get("made_until"), window.runs))
        return window


async def _user_with_runs(store: MemoryStore, old: int, recent: int) -> str:
    """A user with ``old`` runs made 5 s ago (settled) and ``recent`` made now, in this window."""
    now = datetime.now(UTC)
    if now - store.window_start(now) < timedelta(seconds=10):  # the runs must share one window
        await asyncio.sleep(10)
        now = datetime.now(UTC)
    user = f"budget-{uuid.uuid4().hex}"
    ids = [new_id(now - timedelta(seconds=5)) for _ in range(old)] + [new_id() for _ in range(recent)]
    await asyncio.gather(*(store.record_usage(user, str(run_id), RUN) for run_id in ids))
    return user


async def _until_folded(seen: ReadsSeen) -> None:
    for _ in range(200):
        if any(until is not None for _, until, _ in seen.reads):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no fold among the reads {seen.reads}")


async def test_a_user_of_many_runs_reads_only_the_runs_since_the_settled_sum(
    memory_store: MemoryStore,
) -> None:
    user = await _user_with_runs(memory_store, old=100, recent=3)
    seen = ReadsSeen(memory_store)
    budgets = Budgets(seen, BudgetConfig(), settled_after_s=SETTLED_AFTER_S)  # type: ignore[arg-type]
    whole = await memory_store.get_usage(user)
    assert whole.runs == 103

    first = await budgets.window(user)
    assert (first.usage, first.runs) == (whole.usage, whole.runs)
    # 103 runs past nothing settled: the settled ones are summed behind the read.
    await _until_folded(seen)
    folded_after, folded_until, folded_runs = seen.reads[-1]
    assert folded_after is None and folded_runs == 100

    seen.reads.clear()
    again = await budgets.window(user)
    assert (again.usage, again.runs) == (whole.usage, whole.runs)
    [(after, until, counted)] = seen.reads
    assert (after, until, counted) == (folded_until, None, 3)

    # A reservation made now is in the next read.
    await memory_store.record_usage(user, str(new_id()), Usage(prompt_tokens=7, completion_tokens=100))
    later = await budgets.window(user)
    assert later.usage.total_tokens == whole.usage.total_tokens + 107 and later.runs == 104

    # In a new window the settled sum is of no use: the whole window is read again.
    seen.turned = timedelta(days=1)
    seen.reads.clear()
    await budgets.window(user)
    assert seen.reads[0] == (None, None, 104)


async def test_a_user_of_few_runs_keeps_one_plain_read(memory_store: MemoryStore) -> None:
    user = await _user_with_runs(memory_store, old=admission.FOLD_AFTER_RUNS - 3, recent=3)
    seen = ReadsSeen(memory_store)
    budgets = Budgets(seen, BudgetConfig(), settled_after_s=SETTLED_AFTER_S)  # type: ignore[arg-type]
    for _ in range(2):
        window = await budgets.window(user)
        assert window.runs == admission.FOLD_AFTER_RUNS
    await asyncio.sleep(0.2)
    assert seen.reads == [(None, None, admission.FOLD_AFTER_RUNS)] * 2
