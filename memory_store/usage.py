"""Token usage per user and budget window, idempotent per run.

Each run's usage is one row of the user's window partition, keyed by run id, so recording the same run
again (a retried finish, or an estimate at start replaced by the actual count at the end) overwrites
it instead of adding to it. Cassandra counters would double count a retried increment. Reading a
user's usage is one single-partition aggregate; a window holds at most the runs the user's budget and
rate limits allowed in it.

A run's window is the one its id was made in, so every record of one run lands in the same window.

The aggregate reads every run of the window, so its cost grows with the runs the user made in it (a
warm node's CPU: ~0.5-1.3 ms for up to a few hundred runs, 1.7 ms for 1,000, 6.5 ms for 4,000;
bench/bench_memory_store.py). A caller that keeps the sum of runs old enough to no longer change reads
only the runs made since (``made_after``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from memory_store.base import StoreBase, micros, now
from memory_store.db import Cql, Write
from memory_store.errors import InvalidArgument
from memory_store.ids import id_time, parse_id
from memory_store.models import Usage, UsageWindow

STATEMENTS = {
    "usage_put": Cql(
        "INSERT INTO usage_by_run (user_id, window_start, run_id, prompt_tokens, cached_prompt_tokens, "
        "completion_tokens) VALUES (?, ?, ?, ?, ?, ?)",
        idempotent=True,
    ),
    "usage_sum": Cql(
        "SELECT sum(prompt_tokens) AS prompt, sum(cached_prompt_tokens) AS cached, "
        "sum(completion_tokens) AS completion, count(*) AS runs "
        "FROM usage_by_run WHERE user_id = ? AND window_start = ?",
        True,
    ),
    # Runs made in (after, until]: maxTimeuuid bounds every id of an instant's millisecond on one side.
    "usage_sum_range": Cql(
        "SELECT sum(prompt_tokens) AS prompt, sum(cached_prompt_tokens) AS cached, "
        "sum(completion_tokens) AS completion, count(*) AS runs "
        "FROM usage_by_run WHERE user_id = ? AND window_start = ? "
        "AND run_id > maxTimeuuid(?) AND run_id <= maxTimeuuid(?)",
        True,
    ),
}
# Before any run id of a window: maxTimeuuid's resolution is a millisecond.
_BEFORE_WINDOW = timedelta(milliseconds=1)


class UsageMixin(StoreBase):
    def window_start(self, at: datetime) -> datetime:
        """The start of the budget window holding ``at``."""
        seconds = micros(at) // 1_000_000
        return datetime.fromtimestamp(seconds - seconds % self._config.usage_window_s, UTC)

    async def record_usage(self, user_id: str, run_id: str, usage: Usage) -> None:
        """Sets the tokens of ``run_id`` in the user's window (replacing an earlier record of the run)."""
        await self._db.execute(*self._usage_write(user_id, run_id, usage))

    def _usage_write(self, user_id: str, run_id: str, usage: Usage) -> Write:
        """The write of ``record_usage``."""
        self._check_user(user_id)
        run_key = parse_id(run_id, "run id")
        if min(usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) < 0:
            raise InvalidArgument("token counts must not be negative")
        window = self.window_start(id_time(run_key))
        counts = (usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens)
        return "usage_put", (user_id, window, run_key, *counts)

    async def get_usage(
        self,
        user_id: str,
        at: datetime | None = None,
        *,
        made_after: datetime | None = None,
        made_until: datetime | None = None,
    ) -> UsageWindow:
        """The user's usage in the window containing ``at`` (default: now): of every run in it, or with
        ``made_after`` / ``made_until``, of the runs made in (made_after, made_until] only."""
        self._check_user(user_id)
        start = self.window_start(at or now())
        end = start + timedelta(seconds=self._config.usage_window_s)
        if made_after is None and made_until is None:
            rows = await self._db.execute("usage_sum", (user_id, start))
        else:
            bounds = (made_after or start - _BEFORE_WINDOW, made_until or end)
            rows = await self._db.execute("usage_sum_range", (user_id, start, *bounds))
        row = rows[0]
        return UsageWindow(
            user_id=user_id,
            start=start,
            end=end,
            usage=Usage(row["prompt"] or 0, row["cached"] or 0, row["completion"] or 0),
            runs=row["runs"] or 0,
        )
