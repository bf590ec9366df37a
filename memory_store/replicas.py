"""Replicas: orchestrators' heartbeats (``replicas``), the runs of silent ones, and the signals replicas
send each other about runs (``run_signals``).

Orphans: replicas heartbeat into ``replicas``; ``find_orphaned_runs`` returns the runs in the index
(``runs_by_owner``, ``runs.py``) of replicas whose heartbeat is stale, for another replica to adopt
(``adopt_run``) or end interrupted (``finish_run``), or, for a run that ended but whose owner died
before storing what its end leaves, ``settle_run``.

Signals: a replica that ends another's run (a cancel) or adopts it tells the owner (``signal_owner``:
a row in ``run_signals``, by the owner and ten seconds); the owner reads its last few partitions every
few seconds (``signalled_runs``) and reads again only the runs named there, rather than each of its
runs every few seconds.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from memory_store.base import micros, now, utc
from memory_store.db import Cql, Db
from memory_store.errors import InvalidArgument
from memory_store.ids import parse_id
from memory_store.models import Run
from memory_store.runs import Runs
from memory_store.schema import RUN_SIGNAL_BUCKET_SECONDS, RUN_SIGNAL_TTL_S

# The replica group of a deployment's orchestrators (one router pool): replicas adopt the runs of
# silent replicas of their own group only.
ORCHESTRATOR = "orchestrator"
REPLICA_TTL_S = 86_400

STATEMENTS = {
    "signal_insert": Cql(
        "INSERT INTO run_signals (owner_id, bucket, run_id) VALUES (:owner_id, :bucket, :run_id)", True
    ),
    "signal_scan": Cql(
        "SELECT run_id FROM run_signals WHERE owner_id = :owner_id AND bucket = :bucket", True
    ),
    "replica_heartbeat": Cql(
        "INSERT INTO replicas (service, replica_id, heartbeat_at) VALUES (:service, :replica_id, :heartbeat_at) "
        "USING TTL :ttl_s",
        True,
    ),
    "replica_list": Cql("SELECT replica_id, heartbeat_at FROM replicas WHERE service = :service", True),
    "replica_forget": Cql("DELETE FROM replicas WHERE service = :service AND replica_id = :replica_id", True),
}


def _signal_bucket(at: datetime) -> int:
    return micros(at) // 1_000_000 // RUN_SIGNAL_BUCKET_SECONDS


class Replicas:
    """Heartbeats, orphaned runs and signals between the replicas of a group."""

    def __init__(self, db: Db, runs: Runs) -> None:
        self._db = db
        self._runs = runs

    async def signal_owner(self, run: Run, at: datetime | None = None) -> None:
        """Tells replica ``run.owner_id`` to read ``run`` again (another replica ended or adopted it),
        at ``at`` (default now). The signal lives RUN_SIGNAL_TTL_S."""
        if not run.owner_id:
            raise InvalidArgument("a run needs an owner id")
        signal = {"owner_id": run.owner_id, "bucket": _signal_bucket(at or now())}
        await self._db.execute("signal_insert", {**signal, "run_id": parse_id(run.run_id, "run id")})

    async def signalled_runs(self, owner_id: str, since: datetime, until: datetime) -> set[str]:
        """The ids of the runs signalled to ``owner_id`` (``signal_owner``) from ``since`` to ``until``, by
        the signalling replica's clock, in steps of RUN_SIGNAL_BUCKET_SECONDS (a few more may come
        from either end). The caller widens the window by the clock skew it allows between replicas."""
        first, last = _signal_bucket(since), _signal_bucket(until)
        if not 0 <= last - first < RUN_SIGNAL_TTL_S // RUN_SIGNAL_BUCKET_SECONDS:
            raise InvalidArgument(f"signals are read over at most {RUN_SIGNAL_TTL_S}s, oldest first")
        scans = await asyncio.gather(
            *(
                self._db.execute("signal_scan", {"owner_id": owner_id, "bucket": bucket})
                for bucket in range(first, last + 1)
            )
        )
        return {str(row["run_id"]) for rows in scans for row in rows}

    async def heartbeat_replica(
        self, replica_id: str, at: datetime | None = None, group: str = ORCHESTRATOR
    ) -> None:
        """Says that orchestrator replica ``replica_id`` of ``group`` is alive at ``at`` (default now;
        call every few seconds). Its row expires a day after its last heartbeat."""
        if not replica_id or not group:
            raise InvalidArgument("replica id and group must not be empty")
        beat = {"service": group, "replica_id": replica_id, "heartbeat_at": at or now()}
        await self._db.execute("replica_heartbeat", {**beat, "ttl_s": REPLICA_TTL_S})

    async def forget_replica(self, replica_id: str, group: str = ORCHESTRATOR) -> None:
        """Drops a replica's heartbeat (after its orphaned runs were interrupted, or at clean shutdown)."""
        await self._db.execute("replica_forget", {"service": group, "replica_id": replica_id})

    async def find_orphaned_runs(
        self,
        stale_after_s: float = 30.0,
        max_run_age_s: float = 3600.0,
        at: datetime | None = None,
        group: str = ORCHESTRATOR,
    ) -> list[Run]:
        """The runs still in the index of a replica that has not heartbeated for ``stale_after_s``
        seconds: those in progress, for the caller to ``adopt_run`` (or end interrupted), and those
        that ended but whose end it may not have stored (it died between its finish and the answer's
        writes, which take the run out of the index), for the caller to ``settle_run``. Only runs
        started within ``max_run_age_s`` are considered (no run lives longer). Silent replicas without
        such runs are forgotten."""
        at = at or now()
        replicas = await self._db.execute("replica_list", {"service": group})
        stale = [
            r["replica_id"]
            for r in replicas
            if utc(r["heartbeat_at"]) < at - timedelta(seconds=stale_after_s)
        ]
        orphans = await self._runs.indexed_runs(stale, at, max_run_age_s)
        # A silent replica with nothing left to reap is dropped, so later passes do not scan it again
        # (if it was only paused, its next heartbeat brings it back).
        done = set(stale) - {run.owner_id for run in orphans}
        await asyncio.gather(*(self.forget_replica(owner, group) for owner in done))
        return orphans
