"""Admission: the user's token budget per window, and how many runs a user may have at once.

Budget: each tier has a number of tokens (prompt + completion) per window; the window is memory_store's
usage window (aligned to the epoch). A model may have its own number per tier (``--model-budget``),
which replaces the tier's for requests to it: the window's usage is still every model's tokens, so a
model with a lower ceiling is served until the user's window reaches it, the others after that. A run
reserves its estimate, prompt tokens + max_tokens, before it starts; when it ends, memory_store
replaces the estimate with the actual count (usage is stored per run, so this is an overwrite, never a
double count), or, for a run ended without its owner (lost replica, cancel elsewhere), with its prompt
and the output it stored. A request that does not fit the rest of the window is RESOURCE_EXHAUSTED
with the time until the window resets as retry delay.

Check and reserve are serialized per user on this replica, so concurrent sends of one user cannot both
spend the last tokens here. Replicas do not coordinate: sends of one user landing on different replicas
at the same instant can overshoot by at most one run's estimate per replica.

Reading the window sums every run the user made in it, which grows with the runs: a user of 4,000 runs
a day would cost Cassandra ~6.5 ms of CPU a send for it by evening, against ≤ 1.3 ms for a few. A
run's record stops changing once the run has ended and its owner has recorded its count, so each
replica keeps, per user who made more than ``FOLD_AFTER_RUNS`` runs, the sum of the window's runs made
before ``settled_after_s`` ago, and reads only the runs made since. A run is "made" when its budget is
reserved: its record is keyed by a charge id made then (memory_store/usage.py), never by its run id,
which a send retried with an old idempotency key made long before. Such a sum misses a record that
changes later than that: a run adopted more than once, still going, or charged that late.
It then counts the record as it was when folded: mostly the reservation, never less than the charge
(the user is refused early, not let past the budget); for a run reaped and then adopted, the output
it had stored, which the adopter's count may exceed by at most the run's max_tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from chatmesh.errors import exhausted, invalid
from chatmesh.finish import Usage
from chatmesh.identity import Identity
from memory_store.errors import MemoryStoreError
from memory_store.models import UsageWindow
from memory_store.store import MemoryStore
from orchestrator.config import BudgetConfig
from orchestrator.metrics import METRICS

log = logging.getLogger(__name__)

# Concurrent-run limits answer with this retry delay: runs take seconds, not hours.
RUN_SLOT_RETRY_S = 2.0
# A window read that counts more runs than this past a user's settled sum (or from the window's start)
# has the settled runs folded into that sum, behind the send: users of a few runs keep one plain read.
FOLD_AFTER_RUNS = 64
# Users whose settled sum a replica keeps, least recently read dropped first (~200 bytes each).
FOLDED_USERS = 20_000


def check_model_budgets(config: BudgetConfig, served: Sequence[str]) -> None:
    """ValueError for a ``--model-budget`` naming a model none of the ``--model-file``s serves."""
    unknown = sorted({model for model, _, _ in config.per_model} - set(served))
    if unknown:
        raise ValueError(
            f"--model-budget names {', '.join(unknown)}, not served (served models: {', '.join(served)})"
        )


@dataclass(frozen=True)
class SettledUsage:
    """A user's usage in the window starting ``window_start`` by the runs made up to ``until``."""

    window_start: datetime
    until: datetime
    usage: Usage
    runs: int


class Budgets:
    def __init__(self, store: MemoryStore, config: BudgetConfig, settled_after_s: float) -> None:
        """``settled_after_s``: how long after a run starts its usage record may still change (its
        generation's deadline, an adoption's, and its owner's retries to record the end)."""
        self._store = store
        self._config = config
        self._settled_after = timedelta(seconds=settled_after_s)
        self._per_model = {(model, tier): tokens for model, tier, tokens in config.per_model}
        # Per user: the lock and how many sends hold or wait for it.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._settled: OrderedDict[str, SettledUsage] = OrderedDict()
        self._folding: dict[str, asyncio.Task[None]] = {}

    def limit(self, tier: str, model: str = "") -> int:
        """Tokens per window for ``tier``'s requests to ``model`` (its ``--model-budget`` for the tier,
        else the tier's); 0 means unlimited."""
        own = self._per_model.get((model, tier))
        return own if own is not None else self._config.tokens.get(tier, self._config.tokens["free"])

    def _whose(self, tier: str, model: str) -> str:
        """Whose budget ``limit`` gave, for refusals."""
        return (
            f"the {tier} tier's budget for {model}"
            if (model, tier) in self._per_model
            else f"the {tier} tier's budget"
        )

    async def window(self, user_id: str) -> UsageWindow:
        """The user's usage in the current window: the settled sum kept here plus the runs made since."""
        at = datetime.now(UTC)
        settled = self._settled.get(user_id)
        if settled is None or settled.window_start != self._store.window_start(at):
            settled = None
            window = await self._store.get_usage(user_id, at)
            unsettled_runs = window.runs
        else:
            self._settled.move_to_end(user_id)
            recent = await self._store.get_usage(user_id, at, made_after=settled.until)
            window = UsageWindow(
                user_id,
                recent.start,
                recent.end,
                settled.usage + recent.usage,
                settled.runs + recent.runs,
            )
            unsettled_runs = recent.runs
        if unsettled_runs > FOLD_AFTER_RUNS and user_id not in self._folding:
            fold = asyncio.ensure_future(self._fold(user_id, window.start, settled, at))
            self._folding[user_id] = fold
            fold.add_done_callback(lambda _: self._folding.pop(user_id, None))
        return window

    async def _fold(
        self, user_id: str, window_start: datetime, settled: SettledUsage | None, at: datetime
    ) -> None:
        """Adds the runs that settled since ``settled`` (made before ``settled_after`` ago) to it."""
        until = at - self._settled_after
        if until <= (settled.until if settled else window_start):
            return  # none settled yet: the window is younger than settled_after
        try:
            runs = await self._store.get_usage(
                user_id, at, made_after=settled.until if settled else None, made_until=until
            )
        except (MemoryStoreError, TimeoutError) as exc:
            log.info("could not fold the settled usage of %s (%s); the next read tries again", user_id, exc)
            return
        usage, count = (settled.usage, settled.runs) if settled else (Usage(), 0)
        self._settled[user_id] = SettledUsage(window_start, until, usage + runs.usage, count + runs.runs)
        self._settled.move_to_end(user_id)
        while len(self._settled) > FOLDED_USERS:
            self._settled.popitem(last=False)

    async def reserve(self, identity: Identity, charge_id: str, estimate: Usage, model: str) -> None:
        """Reserves ``estimate`` under ``charge_id`` (a run's, made now: the run is charged in the window
        checked here) if the user's window has room under the budget of their tier for ``model`` (else
        RESOURCE_EXHAUSTED)."""
        limit = self.limit(identity.tier, model)
        if limit and estimate.total_tokens > limit:
            raise invalid(
                "options.max_tokens",
                f"this request may use {estimate.total_tokens} tokens (prompt + max_tokens), more than "
                f"{self._whose(identity.tier, model)}, {limit} per window; lower max_tokens",
            )
        async with self._user_lock(identity.user_id):
            if limit:
                await self._check_room(
                    identity.user_id, identity.tier, model, limit, estimate.total_tokens, "this request"
                )
            await self._store.record_usage(identity.user_id, charge_id, estimate)

    async def reserve_more(
        self, user_id: str, tier: str, model: str, charge_id: str, estimate: Usage, more: int
    ) -> None:
        """Raises a running answer's reservation under ``charge_id`` to ``estimate``, ``more`` tokens
        than it held (the turn after a tool step: its prompt holds the turns before it and the step's
        result, docs/tools.md), if the user's window has room for them (else RESOURCE_EXHAUSTED)."""
        async with self._user_lock(user_id):
            if limit := self.limit(tier, model):
                await self._check_room(
                    user_id, tier, model, limit, more, "the answer's turn after a tool step"
                )
            await self._store.record_usage(user_id, charge_id, estimate)

    async def _check_room(
        self, user_id: str, tier: str, model: str, limit: int, tokens: int, what: str
    ) -> None:
        window = await self.window(user_id)
        used = window.usage.total_tokens
        if used + tokens > limit:
            METRICS.budget_rejections.labels(tier, "tokens", model).inc()
            wait_s = (window.end - datetime.now(UTC)).total_seconds()
            raise exhausted(
                f"token budget spent: {used} tokens used in this window, of {limit} ({self._whose(tier, model)}), "
                f"and {what} may use {tokens}; the budget resets at {window.end.isoformat()}",
                wait_s,
            )

    async def release(self, user_id: str, charge_id: str) -> None:
        """Returns a reservation whose run never started."""
        await self._store.record_usage(user_id, charge_id, Usage())

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

    def acquire(self, identity: Identity, model: str) -> None:
        """A run slot for a request to ``model`` (RESOURCE_EXHAUSTED when the user's tier has none left)."""
        limit = self._limits.get(identity.tier, self._limits["free"])
        if self._active[identity.user_id] >= limit:
            METRICS.budget_rejections.labels(identity.tier, "concurrent_runs", model).inc()
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
