"""The budget's window read for a user of many runs (orchestrator/policy/admission.py): the sum of the
runs old enough to no longer change is kept, and only the runs made since are read, with the same total
as a read of the whole window. On a real Cassandra node (and, for a run's charge, a replica's runs in this
process over the shared mesh's router)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.finish import Usage
from chatmesh.identity import Identity
from memory_store.errors import Unavailable
from memory_store.ids import new_id
from memory_store.models import UsageWindow
from memory_store.store import MemoryStore
from orchestrator.config import BudgetConfig
from orchestrator.policy import admission
from orchestrator.policy.admission import Budgets
from orchestrator.runs.send import SendRun
from tests.fixtures.in_process import in_process_replica
from tests.fixtures.orchestrator import Mesh

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


async def test_a_run_started_long_after_its_key_was_claimed_is_counted_past_the_settled_sum(
    memory_store: MemoryStore, mesh: Mesh
) -> None:
    user = await _user_with_runs(memory_store, old=admission.FOLD_AFTER_RUNS + 6, recent=0)
    # The window's runs settle 2 s after they start (2 x max_run_s + finish_retry_s).
    async with in_process_replica(
        memory_store, mesh.router_address, max_run_s=0.75, finish_retry_s=0.5
    ) as replica:
        ctx = replica.parts.ctx
        budgets = ctx.runs.starts.budgets
        me = Identity(user, "pro")
        chat = await memory_store.create_chat(user)
        request = chat_pb2.SendMessageRequest(
            chat_id=chat.chat_id,
            content="hello",
            idempotency_key="k1",
            options=chat_pb2.GenerationOptions(max_tokens=8),
        )
        # The first attempt claims the key (its run id is made now) and is refused: the budget's read of
        # the window fails (so nothing is folded yet).
        replica.store.fail("get_usage")
        with pytest.raises(Unavailable):
            await ctx.runs.starts.start(SendRun(ctx, me, request))
        replica.store.clear("get_usage")
        claimed_at = datetime.now(UTC)

        # Once the claim is older than the settled sum, the runs up to then are folded into it.
        await asyncio.sleep(2 * 0.75 + 0.5 + 1.0)
        await budgets.window(user)
        for _ in range(200):
            if user not in budgets._folding:
                break
            await asyncio.sleep(0.02)
        assert budgets._settled[user].until > claimed_at

        # The retry starts the run of the claimed key now, and is charged for it now.
        retry = SendRun(ctx, me, request)
        run_id = await ctx.runs.starts.start(retry)
        assert retry.live is not None
        [event async for event in retry.live.follow(0)]
        charged = (await memory_store.get_run(user, run_id)).usage
        assert charged is not None and charged.total_tokens > 0
        window = await budgets.window(user)
        whole = await memory_store.get_usage(user)
        assert window.usage == whole.usage
        assert (
            window.usage.total_tokens
            == (admission.FOLD_AFTER_RUNS + 6) * RUN.total_tokens + charged.total_tokens
        )
