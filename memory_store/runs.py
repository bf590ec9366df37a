"""Runs: idempotent send claims, run lifecycle with output checkpoints, and finding orphaned runs.

Idempotency: ``claim_idempotency_key`` is one conditional insert (``IF NOT EXISTS``) of the ids a send
will use. The first claim of a key writes its freshly made ids; every later claim, concurrent or
retried, gets the stored ids back, plus whether its request fingerprint matches. Retrying the insert
after a timeout is safe: if the first attempt landed, the retry reads back our own ids. The first claim
also holds the key's start lease: only a lease holder starts the key's run, so a retry that lands on
another replica while the first attempt is still placing its run waits for it instead of running it
again (``take_start_lease``). A run that ended without an answer (refused before its first token) can be
replaced by a new one for its retry (``renew_claim``, conditional on the run the key has).

A run's partition holds its state in static columns and its output as checkpoint rows
``(first_seq, texts, token_counts, token_ids)``. Writes that may race carry write timestamps that order them:
creation uses the run id's time, a checkpoint that time plus its last sequence number (so a late,
older checkpoint never overwrites a newer one), and the finish is a Paxos write (later still).

Finishing is one conditional batch: the last output rows and the terminal status land together, and
only if the run is still in progress. Whoever wins (the owner, a cancel from another replica, or the
reaper marking it interrupted), the assistant message is then written from the stored output up to
the final sequence number under the id reserved at claim time: a retried finish rewrites the same
row with the same content, so it is stored exactly once.

Orphans: replicas heartbeat into ``replicas``; ``runs_by_owner`` lists each replica's in-progress runs
by start minute. ``find_orphaned_runs`` returns the in-progress runs of replicas whose heartbeat is
stale, for another replica to adopt (``adopt_run``: a conditional change of owner, so exactly one
replica takes each run, and the one it was taken from can no longer finish it) or ``interrupt_run``.
A run leaves its owner's index with the writes that follow its end (its answer and usage), never
before them, so a run that ended but is still there had an owner that died in between: it is returned
too, for ``settle_run`` to store what its end leaves.
Every finish is conditional on the owner the finishing replica last saw: an owner that was only paused
and wakes up after its run was adopted gets ``OwnerChanged`` instead of ending the adopter's run.

Signals: a replica that ends another's run (a cancel) or adopts it tells the owner (``signal_owner``:
a row in ``run_signals``, by the owner and ten seconds); the owner reads its last few partitions every
few seconds (``signalled_runs``) and reads again only the runs named there, rather than each of its
runs every few seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from chatmesh.finish import FinishReason, Usage
from memory_store.base import id_str, micros, now, unset, utc
from memory_store.db import Cql, Row, Write
from memory_store.errors import FailedPrecondition, InvalidArgument, NotFound, OwnerChanged, Unavailable
from memory_store.ids import id_micros, id_time, new_id, parse_id, parse_optional_id
from memory_store.messages import MessagesMixin
from memory_store.models import (
    Chat,
    Claim,
    FinishedRun,
    Message,
    MessageStatus,
    Role,
    Run,
    RunDelta,
    RunOutcome,
    RunStatus,
)
from memory_store.schema import RUN_INDEX_BUCKET_SECONDS, RUN_SIGNAL_BUCKET_SECONDS, RUN_SIGNAL_TTL_S
from memory_store.usage import UsageMixin

# The replica group of a deployment's orchestrators (one router pool): replicas adopt the runs of
# silent replicas of their own group only.
ORCHESTRATOR = "orchestrator"
REPLICA_TTL_S = 86_400
# Runs a checkpoint request may carry (checkpoint_runs); the nodes' unlogged-batch warning is set at it.
CHECKPOINT_BATCH_RUNS = 64
_MAX_FINGERPRINT_BYTES = 64
_RUN_STATE = (
    "user_id, chat_id, user_message_id, parent_message_id, assistant_message_id, model, owner_id, status, "
    "finish_reason, last_seq, checkpointed_at, finished_at, prompt_tokens, cached_prompt_tokens, "
    "completion_tokens, error_code, error_message, generation, charge_id, tokenizer_fingerprint"
)

STATEMENTS = {
    "claim": Cql(
        "INSERT INTO idempotency_keys (user_id, key, fingerprint, run_id, user_message_id, "
        "assistant_message_id, starting_until) VALUES (?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS USING TTL ?",
        # Running it again leaves the same row: the first claim's. The caller recognises its own ids.
        idempotent=True,
    ),
    # A key whose claim expired, while a lease or renewal written later (each write sets the TTL of its
    # own cells only) keeps some of its cells: claimed afresh, as a key without a row.
    "claim_expired": Cql(
        "UPDATE idempotency_keys USING TTL ? SET fingerprint = ?, run_id = ?, user_message_id = ?, "
        "assistant_message_id = ?, starting_until = ? WHERE user_id = ? AND key = ? IF fingerprint = null",
        # As "claim": running it again leaves the first attempt's row, which the caller recognises.
        idempotent=True,
    ),
    # Conditional: the outcome of a timed-out attempt is unknown, and a retry could take a lease twice.
    "lease_take": Cql(
        "UPDATE idempotency_keys USING TTL ? SET starting_until = ? WHERE user_id = ? AND key = ? "
        "IF starting_until < ?",
        False,
    ),
    # Keys claimed before leases existed have none: the first retry may take one.
    "lease_take_unleased": Cql(
        "UPDATE idempotency_keys USING TTL ? SET starting_until = ? WHERE user_id = ? AND key = ? "
        "IF starting_until = null",
        False,
    ),
    # Conditional on the run the key has: of several retries renewing it at once, exactly one does (a
    # retry of a timed-out renewal recognises its own run id).
    "claim_renew": Cql(
        "UPDATE idempotency_keys USING TTL ? SET run_id = ?, assistant_message_id = ?, starting_until = ? "
        "WHERE user_id = ? AND key = ? IF run_id = ?",
        False,
    ),
    "lease_release": Cql(
        "UPDATE idempotency_keys USING TTL ? SET starting_until = ? WHERE user_id = ? AND key = ? "
        "IF starting_until = ?",
        True,
    ),
    "run_insert": Cql(
        "INSERT INTO runs (run_id, user_id, chat_id, user_message_id, parent_message_id, "
        "assistant_message_id, model, owner_id, status, prompt_tokens, generation, charge_id, "
        "tokenizer_fingerprint, last_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0) USING TIMESTAMP ?",
        True,
    ),
    # Once a second per running answer: a span each would be most of a send's trace, and a third of
    # the write's CPU in the orchestrator.
    "run_checkpoint": Cql(
        "INSERT INTO runs (run_id, first_seq, texts, token_counts, token_ids, steps, last_seq, checkpointed_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?",
        True,
        traced=False,
    ),
    "run_tail": Cql(
        "INSERT INTO runs (run_id, first_seq, texts, token_counts, token_ids, steps) VALUES (?, ?, ?, ?, ?, ?)",
        True,
    ),
    # A tool step, alone in its row: of two replicas that both think they own the run (one taken for
    # dead, and its adopter), the first to store an event at that seq keeps it.
    "run_step": Cql(
        "INSERT INTO runs (run_id, first_seq, texts, token_counts, token_ids, steps) VALUES (?, ?, ?, ?, ?, ?) "
        "IF NOT EXISTS",
        # Running it again leaves the first attempt's row, which the caller recognises.
        idempotent=True,
    ),
    "run_finish": Cql(
        "UPDATE runs SET status = ?, finish_reason = ?, last_seq = ?, finished_at = ?, prompt_tokens = ?, "
        "cached_prompt_tokens = ?, completion_tokens = ?, error_code = ?, error_message = ? "
        "WHERE run_id = ? IF status = 'in_progress' AND owner_id = ?",
        True,
    ),
    # Conditional: of several replicas adopting a run at once, exactly one becomes its owner.
    "run_adopt": Cql(
        "UPDATE runs SET owner_id = ? WHERE run_id = ? IF status = 'in_progress' AND owner_id = ?", False
    ),
    "run_get": Cql(f"SELECT {_RUN_STATE} FROM runs WHERE run_id = ? LIMIT 1", True),
    "run_read": Cql(
        f"SELECT {_RUN_STATE}, first_seq, texts, token_counts, token_ids, steps FROM runs WHERE run_id = ?",
        True,
    ),
    "owner_index_insert": Cql("INSERT INTO runs_by_owner (owner_id, bucket, run_id) VALUES (?, ?, ?)", True),
    "owner_index_delete": Cql(
        "DELETE FROM runs_by_owner WHERE owner_id = ? AND bucket = ? AND run_id = ?", True
    ),
    "owner_index_scan": Cql("SELECT run_id FROM runs_by_owner WHERE owner_id = ? AND bucket = ?", True),
    "signal_insert": Cql("INSERT INTO run_signals (owner_id, bucket, run_id) VALUES (?, ?, ?)", True),
    "signal_scan": Cql("SELECT run_id FROM run_signals WHERE owner_id = ? AND bucket = ?", True),
    "replica_heartbeat": Cql(
        "INSERT INTO replicas (service, replica_id, heartbeat_at) VALUES (?, ?, ?) USING TTL ?", True
    ),
    "replica_list": Cql("SELECT replica_id, heartbeat_at FROM replicas WHERE service = ?", True),
    "replica_forget": Cql("DELETE FROM replicas WHERE service = ? AND replica_id = ?", True),
}


def _owner_bucket(run_id: uuid.UUID) -> int:
    return id_micros(run_id) // 1_000_000 // RUN_INDEX_BUCKET_SECONDS


def _run(run_id: uuid.UUID, row: Row) -> Run:
    completion = row["completion_tokens"]
    usage = None
    if completion is not None:
        usage = Usage(row["prompt_tokens"] or 0, row["cached_prompt_tokens"] or 0, completion)
    return Run(
        run_id=str(run_id),
        user_id=row["user_id"],
        chat_id=str(row["chat_id"]),
        parent_message_id=str(row["parent_message_id"]),
        assistant_message_id=str(row["assistant_message_id"]),
        model=row["model"] or "",
        owner_id=row["owner_id"] or "",
        status=RunStatus(row["status"]),
        created_at=id_time(run_id),
        user_message_id=id_str(row["user_message_id"]),
        finish_reason=FinishReason(row["finish_reason"]) if row["finish_reason"] else None,
        last_seq=row["last_seq"] or 0,
        checkpointed_at=utc(row["checkpointed_at"]),
        finished_at=utc(row["finished_at"]),
        usage=usage,
        error_code=row["error_code"],
        error_message=row["error_message"],
        prompt_tokens=row["prompt_tokens"] or 0,
        generation=row["generation"] or b"",
        charge_id=str(row["charge_id"] or run_id),
        tokenizer_fingerprint=row["tokenizer_fingerprint"] or "",
    )


def _finished(run: Run, outcome: RunOutcome, at: datetime) -> Run:
    """``run`` as the finish that won with ``outcome`` left it: what ``run_finish`` writes (a field
    the outcome leaves None is left as it was; ``checkpointed_at`` is as ``run`` had it)."""

    def kept(new: Any, old: Any) -> Any:
        return old if new is None else new

    usage = outcome.usage
    return dataclasses.replace(
        run,
        status=RunStatus(outcome.status),
        finish_reason=kept(outcome.finish_reason and FinishReason(outcome.finish_reason), run.finish_reason),
        last_seq=outcome.last_seq,
        finished_at=at,
        usage=kept(usage, run.usage),
        prompt_tokens=usage.prompt_tokens if usage else run.prompt_tokens,
        error_code=kept(outcome.error_code, run.error_code),
        error_message=kept(outcome.error_message, run.error_message),
    )


def _deltas(rows: Sequence[Row], after_seq: int, upto_seq: int | None) -> list[RunDelta]:
    """The output events in checkpoint rows with after_seq < seq <= upto_seq, in order, each once.

    Rows may overlap: a replica taken for dead may write one more checkpoint after the run's adopter
    wrote its own from another first_seq. Their events are the same (regenerated exactly), so the
    first row holding a seq gives it."""
    out: list[RunDelta] = []
    for row in sorted((r for r in rows if r["first_seq"] is not None), key=lambda r: r["first_seq"]):
        counts = row["token_counts"] or ()
        # A row's token ids are its events' ids end to end, split by their counts (none in older rows).
        ids = row.get("token_ids") or ()
        kept = len(ids) == sum(counts)
        steps = row.get("steps") or ()
        start = 0
        for i, (text, tokens) in enumerate(zip(row["texts"] or (), counts, strict=True)):
            seq = row["first_seq"] + i
            fresh = not out or seq > out[-1].seq
            if fresh and seq > after_seq and (upto_seq is None or seq <= upto_seq):
                step = steps[i] if i < len(steps) else ""
                out.append(
                    RunDelta(seq, text, tokens, tuple(ids[start : start + tokens]) if kept else (), step)
                )
            start += tokens
    return out


def _steps(deltas: Sequence[RunDelta]) -> list[str] | None:
    """A checkpoint row's step records, one per event ("" for text), None where it holds no step."""
    return [d.step for d in deltas] if any(d.step for d in deltas) else None


def _token_ids(deltas: Sequence[RunDelta]) -> list[int] | None:
    """A checkpoint row's token ids (None unless every event kept its own)."""
    if any(len(d.token_ids) != d.token_count for d in deltas):
        return None
    return [token for d in deltas for token in d.token_ids]


class RunsMixin(MessagesMixin, UsageMixin):
    async def claim_idempotency_key(
        self, user_id: str, key: str, fingerprint: bytes, start_lease_s: float = 0.0
    ) -> Claim:
        """Reserves the ids of a send (run, user message, assistant message) for ``(user_id, key)``.

        The same key always returns the same ids, however many callers race, until it expires
        (``idempotency_ttl_s`` after its claim); ``fingerprint`` (a hash of the request) tells a true
        retry from a different request reusing the key. The call that creates the claim also holds its
        start lease for ``start_lease_s`` (``take_start_lease``).
        """
        self._check_user(user_id)
        self._check_idempotency_key(key)
        if not 1 <= len(fingerprint) <= _MAX_FINGERPRINT_BYTES:
            raise InvalidArgument(f"request fingerprint must be 1..{_MAX_FINGERPRINT_BYTES} bytes")
        user_message_id, run_id, assistant_message_id = new_id(), new_id(), new_id()
        lease = now() + timedelta(seconds=start_lease_s)
        params = (
            user_id,
            key,
            fingerprint,
            run_id,
            user_message_id,
            assistant_message_id,
            lease,
            self._config.idempotency_ttl_s,
        )
        row = await self._contended("claim", params)
        if not row["[applied]"] and row["fingerprint"] is None:
            # Only a claim writes the fingerprint, and nothing outlives it but later writes' cells.
            ttl = self._config.idempotency_ttl_s
            ids = (fingerprint, run_id, user_message_id, assistant_message_id, lease)
            row = await self._contended("claim_expired", (ttl, *ids, user_id, key))
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
        self._check_user(user_id)
        at = now()
        lease = at + timedelta(seconds=lease_s)
        ttl = self._config.idempotency_ttl_s
        row = (await self._db.execute("lease_take", (ttl, lease, user_id, key, at)))[0]
        if not row["[applied]"] and "starting_until" in row and row["starting_until"] is None:
            row = (await self._db.execute("lease_take_unleased", (ttl, lease, user_id, key)))[0]
        return lease if row["[applied]"] else None

    async def renew_claim(self, user_id: str, key: str, claim: Claim, start_lease_s: float) -> Claim | None:
        """Gives a claimed key a new run in place of ``claim``'s, one that ended without an answer (the
        caller's judgement: refused before its first token): new run and assistant message ids, the
        same user message, and the start lease for ``start_lease_s``. A retry with the key then starts
        the answer again for the question the refused run left stored, instead of joining that run.

        None if the key's run is no longer ``claim``'s (another retry renewed it first: claim the key
        again to read its run). The refused run keeps its own events and status.
        """
        self._check_user(user_id)
        new_run, assistant = new_id(), new_id()
        lease = now() + timedelta(seconds=start_lease_s)
        old = parse_id(claim.run_id, "run id")
        params = (self._config.idempotency_ttl_s, new_run, assistant, lease, user_id, key, old)
        row = await self._contended("claim_renew", params)
        if not row["[applied]"] and row["run_id"] != new_run:
            return None
        return dataclasses.replace(
            claim, run_id=str(new_run), assistant_message_id=str(assistant), start_lease=lease
        )

    async def release_start_lease(self, user_id: str, key: str, lease: datetime) -> None:
        """Gives up a start lease taken with ``claim_idempotency_key`` or ``take_start_lease`` (a no-op
        if it expired and someone else holds the key's lease now)."""
        self._check_user(user_id)
        ttl = self._config.idempotency_ttl_s
        await self._db.execute("lease_release", (ttl, now() - timedelta(seconds=1), user_id, key, lease))

    async def create_run(
        self,
        user_id: str,
        chat_id: str,
        *,
        run_id: str,
        parent_message_id: str,
        assistant_message_id: str,
        model: str,
        owner_id: str,
        user_message_id: str | None = None,
        prompt_tokens: int = 0,
        generation: bytes = b"",
        charge_id: str = "",
        asked: Message | None = None,
        chat: Chat | None = None,
        tokenizer_fingerprint: str = "",
    ) -> Run:
        """Starts a run (in progress, owned by replica ``owner_id``) and makes it the chat's active run.

        The ids come from ``claim_idempotency_key``. Creating the same run again is harmless: it never
        moves a run that has progressed or finished back to its start. ``prompt_tokens`` is what the
        run is charged for its prompt if it ends without its owner's count (``finish_run``);
        ``generation`` is how it is generated (opaque here), for a replica that adopts it.
        ``charge_id`` is the id its budget was reserved under (``record_usage``; default: its run id),
        which every later charge of the run uses. ``tokenizer_fingerprint``: the tokenizer of its prompt
        and output, which its answer's token count is stored as one of.

        ``asked`` is the user message the run answers (its parent, and its ``user_message_id``), stored
        by this same call, as a send does: the run is written only once the message is, so a run never
        exists without the message it answers. ``chat`` is the chat as the caller read it in this same
        request, with the branch ``asked`` continues (its ownership and ``asked``'s parent are known):
        nothing is read again, and the message, the run and the run's index entry go in one round trip,
        one logged batch (two round trips, the message first, for a batch over ``max_batch_bytes``);
        otherwise the checks go first, with the index entry.
        """
        run_key = parse_id(run_id, "run id")
        parent = parse_id(parent_message_id, "parent message id")
        assistant = parse_id(assistant_message_id, "assistant message id")
        user_message = parse_optional_id(user_message_id, "user message id")
        charge_key = parse_id(charge_id, "charge id") if charge_id else run_key
        if not owner_id or len(model) > self.limits.max_model_chars:
            raise InvalidArgument("a run needs an owner id and a model name of reasonable length")
        self._check_fingerprint(tokenizer_fingerprint)
        if len(generation) > self.bounds.max_generation_bytes:
            raise InvalidArgument(f"a run's generation is at most {self.bounds.max_generation_bytes} bytes")
        if parent.time >= assistant.time:
            raise FailedPrecondition("the assistant message id must be newer than the message it answers")
        chat_key = parse_id(chat_id, "chat id")
        if asked is not None:
            if not (asked.message_id == parent_message_id == user_message_id and asked.role is Role.USER):
                raise InvalidArgument("the message a run is created with must be the user message it answers")
            self._check_size(asked)
        # The index entry is written before the run, or with it: a run that exists can always be found
        # by the reaper. An entry whose run is never written is skipped when the index is read.
        index_entry: Write = ("owner_index_insert", (owner_id, _owner_bucket(run_key), run_key))
        run_writes: list[list[Write]] = [
            [
                (
                    "run_insert",
                    (
                        run_key,
                        user_id,
                        chat_key,
                        unset(user_message),
                        parent,
                        assistant,
                        model,
                        owner_id,
                        RunStatus.IN_PROGRESS.value,
                        prompt_tokens,
                        unset(generation or None),
                        charge_key,
                        unset(tokenizer_fingerprint or None),
                        id_micros(run_key),
                    ),
                )
            ],
            [self._active_run_write(user_id, chat_id, run_id)],
        ]
        if chat is not None and (chat.chat_id != str(chat_key) or chat.user_id != user_id):
            raise InvalidArgument("the chat read for this run is another one")
        if asked is not None and chat is not None:
            await self._check_message(asked, parent_known=True)
            first: list[list[Write]] = [[index_entry], *self._message_writes(chat, asked)]
            await self._db.write_in_order(first, run_writes, self._config.max_batch_bytes)
            self._bucket_registered(chat, asked)
        else:
            checks = self._check_message(asked) if asked is not None else self._check_parent(chat_key, parent)
            chat, _ = await self._with_owner(
                user_id, chat_id, asyncio.gather(checks, self._db.execute(*index_entry))
            )
            if asked is not None:
                await self._write_message(chat, asked)
            await self._db.write(run_writes, self._config.max_batch_bytes)
        return Run(
            run_id=str(run_key),
            user_id=user_id,
            chat_id=str(chat_key),
            parent_message_id=str(parent),
            assistant_message_id=str(assistant),
            model=model,
            owner_id=owner_id,
            status=RunStatus.IN_PROGRESS,
            created_at=id_time(run_key),
            user_message_id=id_str(user_message),
            prompt_tokens=prompt_tokens,
            generation=generation,
            charge_id=str(charge_key),
            tokenizer_fingerprint=tokenizer_fingerprint,
        )

    async def adopt_run(self, run: Run, owner_id: str) -> Run | None:
        """Makes replica ``owner_id`` the owner of ``run`` if it is still in progress and still owned by
        ``run.owner_id`` (the replica found silent): the run as adopted, or None if another replica
        adopted or ended it first. The run is indexed under its new owner first, so it can always be
        found again if the adopter dies too. Its own owner may take it up again (a run it found it
        does not hold): the write then only checks that it is still in progress and still its own."""
        if not owner_id:
            raise InvalidArgument("a run needs an owner id")
        run_key = parse_id(run.run_id, "run id")
        bucket = _owner_bucket(run_key)
        if owner_id == run.owner_id:  # its owner takes it up again: its index entry stays as it is
            applied = (await self._db.execute("run_adopt", (owner_id, run_key, run.owner_id)))[0]["[applied]"]
            return run if applied else None
        await self._db.execute("owner_index_insert", (owner_id, bucket, run_key))
        applied = (await self._db.execute("run_adopt", (owner_id, run_key, run.owner_id)))[0]["[applied]"]
        if not applied:
            await self._db.execute("owner_index_delete", (owner_id, bucket, run_key))
            return None
        await self._db.execute("owner_index_delete", (run.owner_id, bucket, run_key))
        return dataclasses.replace(run, owner_id=owner_id)

    async def checkpoint_run(self, run: Run, deltas: Sequence[RunDelta]) -> None:
        """Stores output events (consecutive sequence numbers) so any replica can replay them."""
        if deltas:
            await self._db.execute(*self._checkpoint(run, deltas))

    async def checkpoint_runs(self, checkpoints: Sequence[tuple[Run, Sequence[RunDelta]]]) -> list[bool]:
        """``checkpoint_run`` for several runs at once, in as few requests as Cassandra takes well
        (``Db.write_unlogged``: up to CHECKPOINT_BATCH_RUNS runs, and ``max_batch_bytes``, a request).
        Returns whether each run's events were stored; a run whose were not keeps them to retry."""
        writes = [self._checkpoint(run, deltas) for run, deltas in checkpoints]
        return await self._db.write_unlogged(writes, self._config.max_batch_bytes, CHECKPOINT_BATCH_RUNS)

    async def store_step(self, run: Run, step: RunDelta) -> str:
        """Stores a tool step event (``step.step``, its record, and the tokens of the call it holds)
        in a row of its own unless an event is stored at its seq already; returns the record the event
        at that seq holds: ``step.step`` if it is this one, another step's, or "" (a text event). The
        caller's pending events before it must be stored first (``checkpoint_run``)."""
        if not step.step or step.text:
            raise InvalidArgument("a step event holds a step record and no text")
        self._check_deltas([step])
        run_key = parse_id(run.run_id, "run id")
        params = (run_key, step.seq, [""], [step.token_count], _token_ids([step]), [step.step])
        row = await self._contended("run_step", params)
        if row["[applied]"]:
            return step.step
        steps = row.get("steps") or ()
        return steps[0] if steps else ""

    def _checkpoint(self, run: Run, deltas: Sequence[RunDelta]) -> Write:
        first_seq = self._check_deltas(deltas)
        if first_seq is None:
            raise InvalidArgument("a checkpoint holds at least one event")
        run_key = parse_id(run.run_id, "run id")
        last_seq = deltas[-1].seq
        return (
            "run_checkpoint",
            (
                run_key,
                first_seq,
                [d.text for d in deltas],
                [d.token_count for d in deltas],
                _token_ids(deltas),
                _steps(deltas),
                last_seq,
                now(),
                id_micros(run_key) + last_seq,
            ),
        )

    def _check_deltas(self, deltas: Sequence[RunDelta]) -> int | None:
        """Validates a checkpoint's events; returns the first sequence number (None if empty)."""
        if not deltas:
            return None
        if len(deltas) > self.bounds.max_checkpoint_deltas:
            raise InvalidArgument(f"at most {self.bounds.max_checkpoint_deltas} events per checkpoint")
        # One pass over the events (a replica checkpoints every running answer twice a second).
        first = deltas[0].seq
        text_bytes = 0
        for seq, delta in enumerate(deltas, first):
            if delta.seq != seq or first < 1:
                raise InvalidArgument("checkpointed events must have consecutive sequence numbers from 1 up")
            if delta.token_ids and len(delta.token_ids) != delta.token_count:
                raise InvalidArgument("an event's token ids must number its token count")
            text_bytes += len(delta.text) if delta.text.isascii() else len(delta.text.encode())
            text_bytes += len(delta.step)
        if text_bytes > self.bounds.max_checkpoint_bytes:
            raise InvalidArgument(
                f"a checkpoint holds at most {self.bounds.max_checkpoint_bytes} bytes of text"
            )
        return first

    async def finish_run(
        self, run: Run, outcome: RunOutcome, output: Sequence[RunDelta] | None = None
    ) -> FinishedRun:
        """Ends the run (if it is still in progress) and stores its assistant message exactly once.

        Safe to retry, and safe to race: the first finish wins; later ones return ``applied=False``
        with the run as it ended, and still make sure its message, usage and chat state are stored.

        ``output`` is the run's whole output (every delta, from the first) as its owner holds it, the
        checkpoints and ``outcome.tail`` together. When this finish wins, the run ended exactly as
        ``outcome`` says and its stored output is ``output``, so nothing is read back (a serial read
        of the run's partition saved); otherwise the run as it ended is read, and its stored output.
        """
        status = RunStatus(outcome.status)
        if not status.terminal:
            raise InvalidArgument("a run can only finish as completed, cancelled, failed or interrupted")
        if outcome.tail and outcome.tail[-1].seq > outcome.last_seq:
            raise InvalidArgument("last_seq must be at least the sequence number of the last event")
        if (
            outcome.error_message is not None
            and len(outcome.error_message) > self.bounds.max_error_message_chars
        ):
            raise InvalidArgument(
                f"error message is longer than {self.bounds.max_error_message_chars} characters"
            )
        run_key = parse_id(run.run_id, "run id")
        usage = outcome.usage
        finished_at = now()
        statements: list[tuple[str, tuple[Any, ...]]] = [
            (
                "run_finish",
                (
                    status.value,
                    unset(outcome.finish_reason and FinishReason(outcome.finish_reason).value),
                    outcome.last_seq,
                    finished_at,
                    unset(usage and usage.prompt_tokens),
                    unset(usage and usage.cached_prompt_tokens),
                    unset(usage and usage.completion_tokens),
                    unset(outcome.error_code),
                    unset(outcome.error_message),
                    run_key,
                    run.owner_id,
                ),
            )
        ]
        first_seq = self._check_deltas(outcome.tail)
        if first_seq is not None:
            texts = [d.text for d in outcome.tail]
            counts = [d.token_count for d in outcome.tail]
            tail = outcome.tail
            statements.append(
                ("run_tail", (run_key, first_seq, texts, counts, _token_ids(tail), _steps(tail)))
            )
        applied = (await self._db.execute_batch(statements))[0]["[applied]"]
        if applied and output is not None:
            final = _finished(run, outcome, finished_at)
            stored = [d for d in output if d.seq <= outcome.last_seq]
        else:
            final, stored = await self._ended_run(run, run_key)
        return FinishedRun(run=final, message=await self._settle(final, stored), applied=applied)

    async def settle_run(self, run: Run) -> FinishedRun:
        """Stores what the end of ``run`` leaves (its assistant message, usage and chat state, as a
        finish that lost its race does) and takes it out of its owner's index: for an ended run its
        owner's index still holds, whose owner may have died between the finish and those writes."""
        final, stored = await self._ended_run(run, parse_id(run.run_id, "run id"))
        return FinishedRun(run=final, message=await self._settle(final, stored), applied=False)

    async def _settle(self, final: Run, stored: list[RunDelta]) -> Message | None:
        """The writes that follow a run's end: its answer (None if none is stored), its usage, and then
        the removal of its entry in its owner's index, which only goes with or after the rest (the
        reaper settles an ended run it finds there: ``find_orphaned_runs``)."""
        # The user's budget holds the run's reservation (prompt + max_tokens) until now; a run ended
        # without its owner's count (interrupted, orphaned, cancelled elsewhere) is charged what it
        # stored. An owner that is still alive overwrites this with its own count.
        charged = final.usage or Usage(
            prompt_tokens=final.prompt_tokens, completion_tokens=sum(d.token_count for d in stored)
        )
        usage = [[self._usage_write(final.user_id, final.charge_id, charged)]]
        run_key = parse_id(final.run_id, "run id")
        settled = [[("owner_index_delete", (final.owner_id, _owner_bucket(run_key), run_key))]]
        message = await self._store_answer(final, stored, usage, settled)
        if message is None:  # no answer stored: the rest goes alone, and clears the chat's active run
            cleared = [self._active_run_cleared(final.user_id, final.chat_id, final.run_id)]
            await self._db.write([*usage, cleared], self._config.max_batch_bytes, settled)
        return message

    async def _ended_run(self, run: Run, run_key: uuid.UUID) -> tuple[Run, list[RunDelta]]:
        """The run as it ended, and its stored output, read after a finish (ours or another's)."""
        final, rows = await self._read_run(run_key, serial=True)
        if final is None or final.user_id != run.user_id:
            raise NotFound(f"run {run.run_id} not found")
        if not final.status.terminal:
            if final.owner_id != run.owner_id:
                raise OwnerChanged(f"run {run.run_id} is owned by replica {final.owner_id} now")
            raise Unavailable(f"run {run.run_id} did not finish; retry")
        return final, _deltas(rows, 0, final.last_seq)

    async def _store_answer(
        self,
        run: Run,
        deltas: list[RunDelta],
        others: Sequence[Sequence[Write]],
        then: Sequence[Sequence[Write]],
    ) -> Message | None:
        """Writes the run's assistant message from its stored output, and with it clears the chat's
        active run and writes ``others`` and ``then`` (``Db.write``) (None if there is nothing to store,
        or no chat to store it in: then nothing is written)."""
        content = "".join(d.text for d in deltas)
        if not content and run.status is not RunStatus.COMPLETED:
            return None
        usage = run.usage
        message = Message(
            message_id=run.assistant_message_id,
            chat_id=run.chat_id,
            role=Role.ASSISTANT,
            content=content,
            parent_id=run.parent_message_id,
            token_count=usage.completion_tokens if usage else sum(d.token_count for d in deltas),
            model=run.model or None,
            finish_reason=run.finish_reason,
            status=MessageStatus.COMPLETE if run.status is RunStatus.COMPLETED else MessageStatus.INCOMPLETE,
            run_id=run.run_id,
            usage=usage,
            tokenizer_fingerprint=run.tokenizer_fingerprint,
        )
        try:
            # The parent was checked when the run was created, and messages are only ever deleted
            # with their chat, which the ownership check sees: no need to read it again.
            chat, _ = await self._with_owner(
                run.user_id, run.chat_id, self._check_message(message, parent_known=True)
            )
        except NotFound:
            return None  # the chat was deleted while the run went on: nothing to attach the answer to
        await self._write_message(
            chat, message, [self._active_run_cleared(run.user_id, run.chat_id, run.run_id)], others, then
        )
        return message

    async def interrupt_run(self, run: Run) -> FinishedRun:
        """Marks an orphaned run interrupted, keeping the output checkpointed so far."""
        return await self.finish_run(run, RunOutcome(status=RunStatus.INTERRUPTED, last_seq=run.last_seq))

    async def get_run(self, user_id: str, run_id: str) -> Run:
        self._check_user(user_id)
        run_key = parse_id(run_id, "run id")
        rows = await self._db.execute("run_get", (run_key,))
        if not rows or rows[0]["user_id"] != user_id or rows[0]["status"] is None:
            raise NotFound(f"run {run_id} not found")
        return _run(run_key, rows[0])

    async def read_run_output(self, user_id: str, run_id: str, after_seq: int = 0) -> list[RunDelta]:
        """The run's stored output events with seq > after_seq (up to the final one once it ended)."""
        self._check_user(user_id)
        run, rows = await self._read_run(parse_id(run_id, "run id"), serial=False)
        if run is None or run.user_id != user_id:
            raise NotFound(f"run {run_id} not found")
        return _deltas(rows, after_seq, run.last_seq if run.status.terminal else None)

    async def _read_run(self, run_key: uuid.UUID, serial: bool) -> tuple[Run | None, list[Row]]:
        # A serial read completes any Paxos round in flight, so it sees who won a finish race.
        rows = await self._db.execute("run_read", (run_key,), consistency=self._db.serial if serial else None)
        if not rows or rows[0]["status"] is None:
            return None, rows
        return _run(run_key, rows[0]), rows

    async def signal_owner(self, run: Run, at: datetime | None = None) -> None:
        """Tells replica ``run.owner_id`` to read ``run`` again (another replica ended or adopted it),
        at ``at`` (default now). The signal lives RUN_SIGNAL_TTL_S."""
        if not run.owner_id:
            raise InvalidArgument("a run needs an owner id")
        bucket = micros(at or now()) // 1_000_000 // RUN_SIGNAL_BUCKET_SECONDS
        await self._db.execute("signal_insert", (run.owner_id, bucket, parse_id(run.run_id, "run id")))

    async def signalled_runs(self, owner_id: str, since: datetime, until: datetime) -> set[str]:
        """The ids of the runs signalled to ``owner_id`` (``signal_owner``) from ``since`` to ``until``, by
        the signalling replica's clock, in steps of RUN_SIGNAL_BUCKET_SECONDS (a few more may come
        from either end). The caller widens the window by the clock skew it allows between replicas."""
        first = micros(since) // 1_000_000 // RUN_SIGNAL_BUCKET_SECONDS
        last = micros(until) // 1_000_000 // RUN_SIGNAL_BUCKET_SECONDS
        if not 0 <= last - first < RUN_SIGNAL_TTL_S // RUN_SIGNAL_BUCKET_SECONDS:
            raise InvalidArgument(f"signals are read over at most {RUN_SIGNAL_TTL_S}s, oldest first")
        scans = await asyncio.gather(
            *(self._db.execute("signal_scan", (owner_id, bucket)) for bucket in range(first, last + 1))
        )
        return {str(row["run_id"]) for rows in scans for row in rows}

    async def heartbeat_replica(
        self, replica_id: str, at: datetime | None = None, group: str = ORCHESTRATOR
    ) -> None:
        """Says that orchestrator replica ``replica_id`` of ``group`` is alive at ``at`` (default now;
        call every few seconds). Its row expires a day after its last heartbeat."""
        if not replica_id or not group:
            raise InvalidArgument("replica id and group must not be empty")
        await self._db.execute("replica_heartbeat", (group, replica_id, at or now(), REPLICA_TTL_S))

    async def forget_replica(self, replica_id: str, group: str = ORCHESTRATOR) -> None:
        """Drops a replica's heartbeat (after its orphaned runs were interrupted, or at clean shutdown)."""
        await self._db.execute("replica_forget", (group, replica_id))

    async def find_orphaned_runs(
        self,
        stale_after_s: float = 30.0,
        max_run_age_s: float = 3600.0,
        at: datetime | None = None,
        group: str = ORCHESTRATOR,
    ) -> list[Run]:
        """The runs still in the index of a replica that has not heartbeated for ``stale_after_s``
        seconds: those in progress, for the caller to ``adopt_run`` (or ``interrupt_run``), and those
        that ended but whose end it may not have stored (it died between its finish and the answer's
        writes, which take the run out of the index), for the caller to ``settle_run``. Only runs
        started within ``max_run_age_s`` are considered (no run lives longer). Silent replicas without
        such runs are forgotten."""
        at = at or now()
        replicas = await self._db.execute("replica_list", (group,))
        stale = [
            r["replica_id"]
            for r in replicas
            if utc(r["heartbeat_at"]) < at - timedelta(seconds=stale_after_s)
        ]
        orphans = await self._indexed_runs(stale, at, max_run_age_s)
        # A silent replica with nothing left to reap is dropped, so later passes do not scan it again
        # (if it was only paused, its next heartbeat brings it back).
        done = set(stale) - {run.owner_id for run in orphans}
        await asyncio.gather(*(self.forget_replica(owner, group) for owner in done))
        return orphans

    async def find_owned_runs(
        self,
        owner_id: str,
        skip: Callable[[str], bool] = lambda run_id: False,
        max_run_age_s: float = 3600.0,
        at: datetime | None = None,
    ) -> list[Run]:
        """The runs in replica ``owner_id``'s index, as ``find_orphaned_runs`` finds those of a silent
        replica (in progress, or ended without what the end leaves stored), for a replica to find its
        own that it does not know it holds. ``skip``: run ids not to read (those it knows it holds)."""
        return await self._indexed_runs([owner_id], at or now(), max_run_age_s, skip)

    async def _indexed_runs(
        self,
        owners: Sequence[str],
        at: datetime,
        max_run_age_s: float,
        skip: Callable[[str], bool] = lambda run_id: False,
    ) -> list[Run]:
        """The runs started within ``max_run_age_s`` of ``at`` that the indexes of ``owners`` hold and
        that one of them still owns (an entry whose run was never written, or was adopted since, is
        passed over), but for those ``skip`` names."""
        last = micros(at) // 1_000_000 // RUN_INDEX_BUCKET_SECONDS
        first = (micros(at) // 1_000_000 - int(max_run_age_s)) // RUN_INDEX_BUCKET_SECONDS
        limit = asyncio.Semaphore(16)

        async def bounded(statement: str, params: tuple) -> list[Row]:
            async with limit:
                return await self._db.execute(statement, params)

        scans = await asyncio.gather(
            *(
                bounded("owner_index_scan", (owner, bucket))
                for owner in owners
                for bucket in range(first, last + 1)
            )
        )
        run_keys = [
            key
            for key in dict.fromkeys(row["run_id"] for rows in scans for row in rows)
            if not skip(str(key))
        ]
        states = await asyncio.gather(*(bounded("run_get", (key,)) for key in run_keys))
        return [
            _run(key, rows[0])
            for key, rows in zip(run_keys, states, strict=True)
            if rows and rows[0]["status"] is not None and rows[0]["owner_id"] in owners
        ]
