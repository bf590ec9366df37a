"""Token usage per user and budget window, idempotent per run.

Each run's usage is one row of the user's window partition, keyed by the run's charge id, so recording
the same run again (a retried finish, or an estimate at start replaced by the actual count at the end)
overwrites it instead of adding to it. Cassandra counters would double count a retried increment.
Reading a user's usage is one single-partition aggregate; a window holds at most the runs the user's
budget and rate limits allowed in it. The table's ``run_id`` column holds charge ids.

A run is charged under its charge id, a timeuuid made when its budget is reserved (its start) and
kept in its run row: every record of one run (the reservation, its owner's count, the charge of a
replica that reaped or adopted it) lands in the window the run started in, in its place in the order
of the window's runs by start. A run id can be days older than its start: a send refused after it
claimed its idempotency key keeps the key's run id for its retry, which the refusal's RetryInfo may
send after the window reset. Runs stored before charge ids are charged under their run id.

The aggregate reads every run of the window, so its cost grows with the runs the user made in it (a
warm node's CPU: ~0.5-1.3 ms for up to a few hundred runs, 1.7 ms for 1,000, 6.5 ms for 4,000;
bench/bench_memory_store.py). A caller that keeps the sum of runs old enough to no longer change reads
only the runs made since (``made_after``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from chatmesh.finish import Usage
from memory_store.base import check_user, micros, now
from memory_store.config import StoreConfig
from memory_store.db import Cql, Db, Write
from memory_store.errors import InvalidArgument
from memory_store.ids import id_time, parse_id
from memory_store.models import UsageWindow

_SUMS = (
    "SELECT sum(prompt_tokens) AS prompt, sum(cached_prompt_tokens) AS cached, "
    "sum(completion_tokens) AS completion, count(*) AS runs "
    "FROM usage_by_run WHERE user_id = :user_id AND window_start = :window_start"
)

STATEMENTS = {
    "usage_put": Cql(
        "INSERT INTO usage_by_run (user_id, window_start, run_id, prompt_tokens, cached_prompt_tokens, "
        "completion_tokens) VALUES (:user_id, :window_start, :run_id, :prompt_tokens, :cached_prompt_tokens, "
        ":completion_tokens)",
        idempotent=True,
    ),
    "usage_sum": Cql(_SUMS, True),
    # Runs started in (after, until]: maxTimeuuid bounds every id of an instant's millisecond on one side.
    "usage_sum_range": Cql(
        f"{_SUMS} AND run_id > maxTimeuuid(:made_after) AND run_id <= maxTimeuuid(:made_until)", True
    ),
}
# Before any charge id of a window: maxTimeuuid's resolution is a millisecond.
_BEFORE_WINDOW = timedelta(milliseconds=1)


class UsageWindows:
    """The tokens each run of a user was charged, by budget window (``usage_by_run``)."""

    def __init__(self, db: Db, config: StoreConfig) -> None:
        self._db = db
        self._config = config

    def window_start(self, at: datetime) -> datetime:
        """The start of the budget window holding ``at``."""
        seconds = micros(at) // 1_000_000
        return datetime.fromtimestamp(seconds - seconds % self._config.usage_window_s, UTC)

    async def record_usage(self, user_id: str, charge_id: str, usage: Usage) -> None:
        """Sets the tokens charged under ``charge_id`` (a run's: ``Run.charge_id``) in the window it was
        made in, replacing an earlier record of the run."""
        await self._db.execute(*self.usage_write(user_id, charge_id, usage))

    def usage_write(self, user_id: str, charge_id: str, usage: Usage) -> Write:
        """The write of ``record_usage``."""
        check_user(user_id, self._config.bounds)
        charge_key = parse_id(charge_id, "charge id")
        if min(usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) < 0:
            raise InvalidArgument("token counts must not be negative")
        return "usage_put", {
            "user_id": user_id,
            "window_start": self.window_start(id_time(charge_key)),
            "run_id": charge_key,
            "prompt_tokens": usage.prompt_tokens,
            "cached_prompt_tokens": usage.cached_prompt_tokens,
            "completion_tokens": usage.completion_tokens,
        }

    async def get_usage(
        self,
        user_id: str,
        at: datetime | None = None,
        *,
        made_after: datetime | None = None,
        made_until: datetime | None = None,
    ) -> UsageWindow:
        """The user's usage in the window containing ``at`` (default: now): of every run in it, or with
        ``made_after`` / ``made_until``, of the runs that started (their charge ids were made) in
        (made_after, made_until] only."""
        check_user(user_id, self._config.bounds)
        start = self.window_start(at or now())
        end = start + timedelta(seconds=self._config.usage_window_s)
        window = {"user_id": user_id, "window_start": start}
        if made_after is None and made_until is None:
            rows = await self._db.execute("usage_sum", window)
        else:
            made = {"made_after": made_after or start - _BEFORE_WINDOW, "made_until": made_until or end}
            rows = await self._db.execute("usage_sum_range", {**window, **made})
        row = rows[0]
        return UsageWindow(
            user_id=user_id,
            start=start,
            end=end,
            usage=Usage(row["prompt"] or 0, row["cached"] or 0, row["completion"] or 0),
            runs=row["runs"] or 0,
        )
