"""Idempotent sends: the ids a send's idempotency key reserves (``idempotency_keys``), and its start lease.

``claim_idempotency_key`` is one conditional insert (``IF NOT EXISTS``) of the ids a send will use. The
first claim of a key writes its freshly made ids; every later claim, concurrent or retried, gets the
stored ids back, plus whether its request fingerprint matches. Retrying the insert after a timeout is
safe: if the first attempt landed, the retry reads back our own ids. The first claim also holds the
key's start lease: only a lease holder starts the key's run, so a retry that lands on another replica
while the first attempt is still placing its run waits for it instead of running it again
(``take_start_lease``). A run that ended without an answer (refused before its first token) can be
replaced by a new one for its retry (``renew_claim``, conditional on the run the key has).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

from memory_store.base import check_idempotency_key, check_user, now
from memory_store.config import StoreConfig
from memory_store.db import Cql, Db
from memory_store.errors import InvalidArgument
from memory_store.ids import new_id, parse_id
from memory_store.models import Claim

_MAX_FINGERPRINT_BYTES = 64
_KEY = "user_id = :user_id AND key = :key"
_SET_LEASE = f"UPDATE idempotency_keys USING TTL :ttl_s SET starting_until = :lease WHERE {_KEY}"

STATEMENTS = {
    "claim": Cql(
        "INSERT INTO idempotency_keys (user_id, key, fingerprint, run_id, user_message_id, "
        "assistant_message_id, starting_until) VALUES (:user_id, :key, :fingerprint, :run_id, "
        ":user_message_id, :assistant_message_id, :lease) IF NOT EXISTS USING TTL :ttl_s",
        # Running it again leaves the same row: the first claim's. The caller recognises its own ids.
        idempotent=True,
    ),
    # A key whose claim expired, while a lease or renewal written later (each write sets the TTL of its
    # own cells only) keeps some of its cells: claimed afresh, as a key without a row.
    "claim_expired": Cql(
        "UPDATE idempotency_keys USING TTL :ttl_s SET fingerprint = :fingerprint, run_id = :run_id, "
        "user_message_id = :user_message_id, assistant_message_id = :assistant_message_id, "
        f"starting_until = :lease WHERE {_KEY} IF fingerprint = null",
        # As "claim": running it again leaves the first attempt's row, which the caller recognises.
        idempotent=True,
    ),
    # Conditional: the outcome of a timed-out attempt is unknown, and a retry could take a lease twice.
    "lease_take": Cql(f"{_SET_LEASE} IF starting_until < :at", False),
    # Keys claimed before leases existed have none: the first retry may take one.
    "lease_take_unleased": Cql(f"{_SET_LEASE} IF starting_until = null", False),
    # Conditional on the run the key has: of several retries renewing it at once, exactly one does (a
    # retry of a timed-out renewal recognises its own run id).
    "claim_renew": Cql(
        "UPDATE idempotency_keys USING TTL :ttl_s SET run_id = :run_id, "
        f"assistant_message_id = :assistant_message_id, starting_until = :lease WHERE {_KEY} "
        "IF run_id = :old_run_id",
        False,
    ),
    "lease_release": Cql(f"{_SET_LEASE} IF starting_until = :held", True),
}


class Claims:
    """The idempotency keys of sends, and their start leases."""

    def __init__(self, db: Db, config: StoreConfig) -> None:
        self._db = db
        self._config = config

    async def claim_idempotency_key(
        self, user_id: str, key: str, fingerprint: bytes, start_lease_s: float = 0.0
    ) -> Claim:
        """Reserves the ids of a send (run, user message, assistant message) for ``(user_id, key)``.

        The same key always returns the same ids, however many callers race, until it expires
        (``idempotency_ttl_s`` after its claim); ``fingerprint`` (a hash of the request) tells a true
        retry from a different request reusing the key. The call that creates the claim also holds its
        start lease for ``start_lease_s`` (``take_start_lease``).
        """
        check_user(user_id, self._config.bounds)
        check_idempotency_key(key, self._config.limits)
        if not 1 <= len(fingerprint) <= _MAX_FINGERPRINT_BYTES:
            raise InvalidArgument(f"request fingerprint must be 1..{_MAX_FINGERPRINT_BYTES} bytes")
        user_message_id, run_id, assistant_message_id = new_id(), new_id(), new_id()
        lease = now() + timedelta(seconds=start_lease_s)
        claim = {
            "user_id": user_id,
            "key": key,
            "fingerprint": fingerprint,
            "run_id": run_id,
            "user_message_id": user_message_id,
            "assistant_message_id": assistant_message_id,
            "lease": lease,
            "ttl_s": self._config.idempotency_ttl_s,
        }
        row = await self._db.execute_contended("claim", claim)
        if not row["[applied]"] and row["fingerprint"] is None:
            # Only a claim writes the fingerprint, and nothing outlives it but later writes' cells.
            row = await self._db.execute_contended("claim_expired", claim)
        mine = row["[applied]"] or row["run_id"] == run_id
        return Claim(
            run_id=str(row["run_id"] if not row["[applied]"] else run_id),
            user_message_id=str(row["user_message_id"] if not row["[applied]"] else user_message_id),
            assistant_message_id=str(
                row["assistant_message_id"] if not row["[applied]"] else assistant_message_id
            ),
            created=mine,
            fingerprint_matches=mine or row["fingerprint"] == fingerprint,
            start_lease=lease if mine else None,
        )

    def unkeyed_claim(self, start_lease_s: float = 0.0) -> Claim:
        """The ids of a send that came without an idempotency key, made here and stored nowhere: no
        retry can name its run, so there is nothing for a claim to guard (no Paxos round), and its
        start lease is its own for ``start_lease_s``."""
        return Claim(
            run_id=str(new_id()),
            user_message_id=str(new_id()),
            assistant_message_id=str(new_id()),
            created=True,
            fingerprint_matches=True,
            start_lease=now() + timedelta(seconds=start_lease_s),
        )

    async def take_start_lease(self, user_id: str, key: str, lease_s: float) -> datetime | None:
        """Takes the start lease of a claimed key if nobody holds it: its expiry if taken, else None.

        Only the holder of a key's lease may start its run; an attempt that finds the run not started
        and the lease held by another (an attempt still placing it, maybe on another replica) waits
        for that run instead of generating it a second time. A lease ends when it expires or its
        holder releases it (refused, the run never started).
        """
        check_user(user_id, self._config.bounds)
        at = now()
        lease = at + timedelta(seconds=lease_s)
        leased = {"ttl_s": self._config.idempotency_ttl_s, "lease": lease, "user_id": user_id, "key": key}
        row = (await self._db.execute("lease_take", {**leased, "at": at}))[0]
        if not row["[applied]"] and "starting_until" in row and row["starting_until"] is None:
            row = (await self._db.execute("lease_take_unleased", leased))[0]
        return lease if row["[applied]"] else None

    async def renew_claim(self, user_id: str, key: str, claim: Claim, start_lease_s: float) -> Claim | None:
        """Gives a claimed key a new run in place of ``claim``'s, one that ended without an answer (the
        caller's judgement: refused before its first token): new run and assistant message ids, the
        same user message, and the start lease for ``start_lease_s``. A retry with the key then starts
        the answer again for the question the refused run left stored, instead of joining that run.

        None if the key's run is no longer ``claim``'s (another retry renewed it first: claim the key
        again to read its run). The refused run keeps its own events and status.
        """
        check_user(user_id, self._config.bounds)
        new_run, assistant = new_id(), new_id()
        lease = now() + timedelta(seconds=start_lease_s)
        renewal = {
            "ttl_s": self._config.idempotency_ttl_s,
            "run_id": new_run,
            "assistant_message_id": assistant,
            "lease": lease,
            "user_id": user_id,
            "key": key,
            "old_run_id": parse_id(claim.run_id, "run id"),
        }
        row = await self._db.execute_contended("claim_renew", renewal)
        if not row["[applied]"] and row["run_id"] != new_run:
            return None
        return dataclasses.replace(
            claim, run_id=str(new_run), assistant_message_id=str(assistant), start_lease=lease
        )

    async def release_start_lease(self, user_id: str, key: str, lease: datetime) -> None:
        """Gives up a start lease taken with ``claim_idempotency_key`` or ``take_start_lease`` (a no-op
        if it expired and someone else holds the key's lease now)."""
        check_user(user_id, self._config.bounds)
        released = {"ttl_s": self._config.idempotency_ttl_s, "lease": now() - timedelta(seconds=1)}
        await self._db.execute("lease_release", {**released, "user_id": user_id, "key": key, "held": lease})
