"""Admission: the user's token budget per window, and how many runs a user may have at once.

Budget: each tier has a number of tokens (prompt + completion) per window; the window is memory_store's
usage window (aligned to the epoch). A run reserves its estimate, prompt tokens + max_tokens, before
it starts; when it ends, memory_store replaces the estimate with the actual count (usage is stored per
run, so this is an overwrite, never a double count), or, for a run ended without its owner (lost
replica, cancel elsewhere), with its prompt and the output it stored. A request that does not fit the rest of the window
is RESOURCE_EXHAUSTED with the time until the window resets as retry delay.

Check and reserve are serialized per user on this replica, so concurrent sends of one user cannot both
spend the last tokens here. Replicas do not coordinate: sends of one user landing on different replicas
at the same instant can overshoot by at most one run's estimate per replica.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from chatmesh.errors import exhausted, invalid
from chatmesh.identity import Identity
from memory_store.models import Usage, UsageWindow
from memory_store.store import MemoryStore
from orchestrator.config import BudgetConfig
from orchestrator.metrics import METRICS

# Concurrent-run limits answer with this retry delay: runs take seconds, not hours.
RUN_SLOT_RETRY_S = 2.0


class Budgets:
    def __init__(self, store: MemoryStore, config: BudgetConfig) -> None:
        self._store = store
        self._config = config
        # Per user: the lock and how many sends hold or wait for it.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def limit(self, tier: str) -> int:
        """Tokens per window for ``tier``; 0 means unlimited."""
        return self._config.tokens.get(tier, self._config.tokens["free"])

    async def window(self, user_id: str) -> UsageWindow:
        return await self._store.get_usage(user_id)

    async def reserve(self, identity: Identity, run_id: str, estimate: Usage) -> None:
        """Reserves ``estimate`` for ``run_id`` if the user's window has room (else RESOURCE_EXHAUSTED)."""
        limit = self.limit(identity.tier)
        if limit and estimate.total_tokens > limit:
            raise invalid(
                "options.max_tokens",
                f"this request may use {estimate.total_tokens} tokens (prompt + max_tokens), more than "
                f"the {identity.tier} tier's whole budget of {limit} per window; lower max_tokens",
            )
        async with self._user_lock(identity.user_id):
            if limit:
                window = await self.window(identity.user_id)
                used = window.usage.total_tokens
                if used + estimate.total_tokens > limit:
                    METRICS.budget_rejections.labels(identity.tier, "tokens").inc()
                    wait_s = (window.end - datetime.now(UTC)).total_seconds()
                    raise exhausted(
                        f"token budget spent: {used} of {limit} tokens used in this window and this "
                        f"request may use {estimate.total_tokens}; the budget resets at "
                        f"{window.end.isoformat()}",
                        wait_s,
                    )
            await self._store.record_usage(identity.user_id, run_id, estimate)

    async def release(self, user_id: str, run_id: str) -> None:
        """Returns a reservation whose run never started."""
        await self._store.record_usage(user_id, run_id, Usage())

    @asynccontextmanager
    async def _user_lock(self, user_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(user_id, (asyncio.Lock(), 0))
        self._locks[user_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[user_id]
            # Keep the map bounded by users with a send in flight.
            if users == 1:
                del self._locks[user_id]
            else:
                self._locks[user_id] = (lock, users - 1)


class RunSlots:
    """Runs in progress per user on this replica, bounded by tier."""

    def __init__(self, limits: dict[str, int]) -> None:
        self._limits = limits
        self._active: Counter[str] = Counter()

    def acquire(self, identity: Identity) -> None:
        limit = self._limits.get(identity.tier, self._limits["free"])
        if self._active[identity.user_id] >= limit:
            METRICS.budget_rejections.labels(identity.tier, "concurrent_runs").inc()
            raise exhausted(
                f"{limit} answers are already being generated for you (the {identity.tier} tier's "
                "limit); wait for one to finish or cancel it",
                RUN_SLOT_RETRY_S,
            )
        self._active[identity.user_id] += 1

    def release(self, user_id: str) -> None:
        self._active[user_id] -= 1
        if self._active[user_id] <= 0:
            del self._active[user_id]
