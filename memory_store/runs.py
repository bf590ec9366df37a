"""Runs: a run's lifecycle with output checkpoints (``runs``), and each replica's index of its runs
(``runs_by_owner``).

A run's partition holds its state in static columns and its output as checkpoint rows
``(first_seq, texts, token_counts, token_ids, steps, logprobs)``. Writes that may race carry write
timestamps that order them: creation uses the run id's time, a checkpoint that time plus its last
sequence number (so a late, older checkpoint never overwrites a newer one), and the finish is a Paxos
write (later still).

Finishing is one conditional batch: the last output rows and the terminal status land together, and
only if the run is still in progress. Whoever wins (the owner, a cancel from another replica, or the
reaper marking it interrupted), the assistant message is then written from the stored output up to
the final sequence number under the id reserved at claim time: a retried finish rewrites the same
row with the same content, so it is stored exactly once.

``runs_by_owner`` lists each replica's in-progress runs by start minute, for the runs of a silent
replica to be found (``replicas.py``) and adopted (``adopt_run``: a conditional change of owner, so
exactly one replica takes each run, and the one it was taken from can no longer finish it). A run
leaves its owner's index with the writes that follow its end (its answer and usage), never before
them, so a run that ended but is still there had an owner that died in between: it is found too, for
``settle_run`` to store what its end leaves. Every finish is conditional on the owner the finishing
replica last saw: an owner that was only paused and wakes up after its run was adopted gets
``OwnerChanged`` instead of ending the adopter's run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from chatmesh.finish import FinishReason, Usage
from chatmesh.router.v1 import router_pb2
from chatmesh.tool_format import caller_runs_calls, parse_answer
from memory_store.base import check_fingerprint, check_user, id_str, micros, now, unset, utc
from memory_store.chats import Chats
from memory_store.config import StoreConfig
from memory_store.db import Cql, Db, Row, Write
from memory_store.errors import FailedPrecondition, InvalidArgument, NotFound, OwnerChanged, Unavailable
from memory_store.ids import id_micros, id_time, parse_id, parse_optional_id
from memory_store.messages import Messages
from memory_store.models import (
    Chat,
    FinishedRun,
    Message,
    MessageStatus,
    NewRun,
    Role,
    Run,
    RunDelta,
    RunOutcome,
    RunStatus,
)
from memory_store.schema import RUN_INDEX_BUCKET_SECONDS
from memory_store.usage import UsageWindows

# Runs a checkpoint request may carry (checkpoint_runs); the nodes' unlogged-batch warning is set at it.
CHECKPOINT_BATCH_RUNS = 64
_RUN_STATE = (
    "user_id, chat_id, user_message_id, parent_message_id, assistant_message_id, model, owner_id, status, "
    "finish_reason, last_seq, checkpointed_at, finished_at, prompt_tokens, cached_prompt_tokens, "
    "completion_tokens, error_code, error_message, generation, charge_id, tokenizer_fingerprint"
)
_OUTPUT = "run_id, first_seq, texts, token_counts, token_ids, steps, logprobs"
_OUTPUT_VALUES = ":run_id, :first_seq, :texts, :token_counts, :token_ids, :steps, :logprobs"
_OWNER_ENTRY = "owner_id = :owner_id AND bucket = :bucket AND run_id = :run_id"

STATEMENTS = {
    "run_insert": Cql(
        "INSERT INTO runs (run_id, user_id, chat_id, user_message_id, parent_message_id, "
        "assistant_message_id, model, owner_id, status, prompt_tokens, generation, charge_id, "
        "tokenizer_fingerprint, last_seq) VALUES (:run_id, :user_id, :chat_id, :user_message_id, "
        ":parent_message_id, :assistant_message_id, :model, :owner_id, :status, :prompt_tokens, :generation, "
        ":charge_id, :tokenizer_fingerprint, 0) USING TIMESTAMP :write_ts",
        True,
    ),
    # Once a second per running answer: a span each would be most of a send's trace, and a third of
    # the write's CPU in the orchestrator.
    "run_checkpoint": Cql(
        f"INSERT INTO runs ({_OUTPUT}, last_seq, checkpointed_at) "
        f"VALUES ({_OUTPUT_VALUES}, :last_seq, :checkpointed_at) USING TIMESTAMP :write_ts",
        True,
        traced=False,
    ),
    "run_tail": Cql(f"INSERT INTO runs ({_OUTPUT}) VALUES ({_OUTPUT_VALUES})", True),
    # A tool step, alone in its row: of two replicas that both think they own the run (one taken for
    # dead, and its adopter), the first to store an event at that seq keeps it.
    "run_step": Cql(
        f"INSERT INTO runs ({_OUTPUT}) VALUES ({_OUTPUT_VALUES}) IF NOT EXISTS",
        # Running it again leaves the first attempt's row, which the caller recognises.
        idempotent=True,
    ),
    "run_finish": Cql(
        "UPDATE runs SET status = :status, finish_reason = :finish_reason, last_seq = :last_seq, "
        "finished_at = :finished_at, prompt_tokens = :prompt_tokens, cached_prompt_tokens = "
        ":cached_prompt_tokens, completion_tokens = :completion_tokens, error_code = :error_code, "
        "error_message = :error_message WHERE run_id = :run_id IF status = 'in_progress' AND owner_id = :owner_id",
        True,
    ),
    # Conditional: of several replicas adopting a run at once, exactly one becomes its owner.
    "run_adopt": Cql(
        "UPDATE runs SET owner_id = :owner_id WHERE run_id = :run_id "
        "IF status = 'in_progress' AND owner_id = :previous_owner_id",
        False,
    ),
    "run_get": Cql(f"SELECT {_RUN_STATE} FROM runs WHERE run_id = :run_id LIMIT 1", True),
    "run_read": Cql(
        f"SELECT {_RUN_STATE}, {_OUTPUT.removeprefix('run_id, ')} FROM runs WHERE run_id = :run_id",
        True,
    ),
    "owner_index_insert": Cql(
        "INSERT INTO runs_by_owner (owner_id, bucket, run_id) VALUES (:owner_id, :bucket, :run_id)", True
    ),
    "owner_index_delete": Cql(f"DELETE FROM runs_by_owner WHERE {_OWNER_ENTRY}", True),
    "owner_index_scan": Cql(
        "SELECT run_id FROM runs_by_owner WHERE owner_id = :owner_id AND bucket = :bucket", True
    ),
}


def _owner_bucket(run_id: uuid.UUID) -> int:
    return id_micros(run_id) // 1_000_000 // RUN_INDEX_BUCKET_SECONDS


def _index_entry(statement: str, owner_id: str, run_key: uuid.UUID) -> Write:
    """An insert or delete of ``run_key``'s entry in its owner's index."""
    return statement, {"owner_id": owner_id, "bucket": _owner_bucket(run_key), "run_id": run_key}


def _output(run_key: uuid.UUID, deltas: Sequence[RunDelta], first_seq: int) -> dict[str, Any]:
    """The values of a row of output events (checkpoint, tail or step), ``first_seq`` the first's."""
    return {
        "run_id": run_key,
        "first_seq": first_seq,
        "texts": [d.text for d in deltas],
        "token_counts": [d.token_count for d in deltas],
        "token_ids": _token_ids(deltas),
        "steps": _steps(deltas),
        "logprobs": [d.logprobs for d in deltas] if any(d.logprobs for d in deltas) else None,
    }


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
        logprobs = row.get("logprobs") or ()
        start = 0
        for i, (text, tokens) in enumerate(zip(row["texts"] or (), counts, strict=True)):
            seq = row["first_seq"] + i
            fresh = not out or seq > out[-1].seq
            if fresh and seq > after_seq and (upto_seq is None or seq <= upto_seq):
                step = steps[i] if i < len(steps) else ""
                token_ids = tuple(ids[start : start + tokens]) if kept else ()
                out.append(
                    RunDelta(seq, text, tokens, token_ids, step, logprobs[i] if i < len(logprobs) else b"")
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


class Runs:
    """Runs: their creation, output, end and adoption, and each replica's index of its runs."""

    def __init__(
        self, db: Db, config: StoreConfig, chats: Chats, messages: Messages, usage: UsageWindows
    ) -> None:
        self._db = db
        self._config = config
        self._chats = chats
        self._messages = messages
        self._usage = usage

    async def create_run(self, new: NewRun) -> Run:
        """Starts a run answering a message already stored (a regeneration: ``new.parent_message_id``),
        in progress, owned by replica ``new.owner_id``, and makes it the chat's active run. The parent
        is checked to be in the chat, and the chat to be the caller's, as the run's index entry is
        written; then the run.

        The ids come from ``claim_idempotency_key``. Creating the same run again is harmless: it never
        moves a run that has progressed or finished back to its start.
        """
        row, index_entry, run_writes = self._run_writes(new)
        checks = asyncio.gather(
            self._messages.check_parent(row["chat_id"], row["parent_message_id"]),
            self._db.execute(*index_entry),
        )
        await self._chats.with_owner(new.user_id, new.chat_id, checks)
        await self._db.write(run_writes, self._config.max_batch_bytes)
        return self._started(new, row)

    async def create_run_with_question(
        self, new: NewRun, asked: Message, chat: Chat, before: Sequence[Message] = ()
    ) -> Run:
        """Stores ``asked``, the message a send asks (a user message, or the last tool result it gives
        back, after ``before``, the others: tool messages, each the parent of the next), and the run
        that answers it (as ``create_run``), as a send does: the run is written only once the messages
        are, so a run never exists without the message it answers. ``chat`` is the chat as the caller
        read it in this same request, with the branch the messages continue (its ownership and the
        first one's parent are known): nothing is read again, and the messages, the run and the run's
        index entry go in one round trip, one logged batch (two round trips, the messages first, for a
        batch over ``max_batch_bytes``).
        """
        if not asked.message_id == new.parent_message_id == new.user_message_id:
            raise InvalidArgument("the message a run is created with must be the message it answers")
        chain = [*before, asked]
        if not (asked.role is Role.USER and not before) and any(m.role is not Role.TOOL for m in chain):
            raise InvalidArgument("a run is created with one user message, or with tool messages")
        if any(m.parent_id != parent.message_id for parent, m in itertools.pairwise(chain)):
            raise InvalidArgument("each tool message a run is created with follows the one before it")
        row, index_entry, run_writes = self._run_writes(new)
        if chat.chat_id != new.chat_id or chat.user_id != new.user_id:
            raise InvalidArgument("the chat read for this run is another one")
        first: list[list[Write]] = [[index_entry]]
        for message in chain:
            self._messages.check_size(message)
            await self._messages.check(message, parent_known=True)
            first += self._messages.writes(chat, message, touch=message is asked)
        await self._db.write_in_order(first, run_writes, self._config.max_batch_bytes)
        for message in chain:
            self._messages.bucket_registered(chat, message)
        return self._started(new, row)

    def _run_writes(self, new: NewRun) -> tuple[dict[str, Any], Write, list[list[Write]]]:
        """The run's row (checked), its index entry, and the writes that create it: its row, and the
        chat's active run. The index entry is written before the run, or with it: a run that exists can
        always be found by the reaper. An entry whose run is never written is skipped when the index is
        read."""
        run_key = parse_id(new.run_id, "run id")
        parent = parse_id(new.parent_message_id, "parent message id")
        assistant = parse_id(new.assistant_message_id, "assistant message id")
        if not new.owner_id or len(new.model) > self._config.limits.max_model_chars:
            raise InvalidArgument("a run needs an owner id and a model name of reasonable length")
        check_fingerprint(new.tokenizer_fingerprint, self._config.bounds)
        max_generation = self._config.bounds.max_generation_bytes
        if len(new.generation) > max_generation:
            raise InvalidArgument(f"a run's generation is at most {max_generation} bytes")
        if parent.time >= assistant.time:
            raise FailedPrecondition("the assistant message id must be newer than the message it answers")
        row = {
            "run_id": run_key,
            "user_id": new.user_id,
            "chat_id": parse_id(new.chat_id, "chat id"),
            "user_message_id": unset(parse_optional_id(new.user_message_id, "user message id")),
            "parent_message_id": parent,
            "assistant_message_id": assistant,
            "model": new.model,
            "owner_id": new.owner_id,
            "status": RunStatus.IN_PROGRESS.value,
            "prompt_tokens": new.prompt_tokens,
            "generation": unset(new.generation or None),
            "charge_id": parse_id(new.charge_id, "charge id") if new.charge_id else run_key,
            "tokenizer_fingerprint": unset(new.tokenizer_fingerprint or None),
            "write_ts": id_micros(run_key),
        }
        active = self._chats.active_run_write(new.user_id, new.chat_id, new.run_id)
        index_entry = _index_entry("owner_index_insert", new.owner_id, run_key)
        return row, index_entry, [[("run_insert", row)], [active]]

    def _started(self, new: NewRun, row: dict[str, Any]) -> Run:
        """The run as ``run_insert`` wrote ``row``."""
        return Run(
            run_id=str(row["run_id"]),
            user_id=new.user_id,
            chat_id=str(row["chat_id"]),
            parent_message_id=str(row["parent_message_id"]),
            assistant_message_id=str(row["assistant_message_id"]),
            model=new.model,
            owner_id=new.owner_id,
            status=RunStatus.IN_PROGRESS,
            created_at=id_time(row["run_id"]),
            user_message_id=id_str(parse_optional_id(new.user_message_id, "user message id")),
            prompt_tokens=new.prompt_tokens,
            generation=new.generation,
            charge_id=str(row["charge_id"]),
            tokenizer_fingerprint=new.tokenizer_fingerprint,
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
        adopt = {"owner_id": owner_id, "run_id": run_key, "previous_owner_id": run.owner_id}
        if owner_id == run.owner_id:  # its owner takes it up again: its index entry stays as it is
            applied = (await self._db.execute("run_adopt", adopt))[0]["[applied]"]
            return run if applied else None
        await self._db.execute(*_index_entry("owner_index_insert", owner_id, run_key))
        applied = (await self._db.execute("run_adopt", adopt))[0]["[applied]"]
        if not applied:
            await self._db.execute(*_index_entry("owner_index_delete", owner_id, run_key))
            return None
        await self._db.execute(*_index_entry("owner_index_delete", run.owner_id, run_key))
        return dataclasses.replace(run, owner_id=owner_id)

    async def checkpoint_runs(self, checkpoints: Sequence[tuple[Run, Sequence[RunDelta]]]) -> list[bool]:
        """Stores each run's output events (consecutive sequence numbers) so any replica can replay
        them, in as few requests as Cassandra takes well (``Db.write_unlogged``: up to
        CHECKPOINT_BATCH_RUNS runs, and ``max_batch_bytes``, a request).
        Returns whether each run's events were stored; a run whose were not keeps them to retry."""
        writes = [self.checkpoint_write(run, deltas) for run, deltas in checkpoints]
        return await self._db.write_unlogged(writes, self._config.max_batch_bytes, CHECKPOINT_BATCH_RUNS)

    async def store_step(self, run: Run, step: RunDelta) -> str:
        """Stores a tool step event (``step.step``, its record, and the tokens of the call it holds)
        in a row of its own unless an event is stored at its seq already; returns the record the event
        at that seq holds: ``step.step`` if it is this one, another step's, or "" (a text event). The
        caller's pending events before it must be stored first (``checkpoint_runs``)."""
        if not step.step or step.text:
            raise InvalidArgument("a step event holds a step record and no text")
        self._check_deltas([step])
        row = await self._db.execute_contended(
            "run_step", _output(parse_id(run.run_id, "run id"), [step], step.seq)
        )
        if row["[applied]"]:
            return step.step
        steps = row.get("steps") or ()
        return steps[0] if steps else ""

    def checkpoint_write(self, run: Run, deltas: Sequence[RunDelta]) -> Write:
        """The write of a run's checkpoint (``checkpoint_runs``; at least one event)."""
        first_seq = self._check_deltas(deltas)
        if first_seq is None:
            raise InvalidArgument("a checkpoint holds at least one event")
        run_key = parse_id(run.run_id, "run id")
        last_seq = deltas[-1].seq
        return "run_checkpoint", {
            **_output(run_key, deltas, first_seq),
            "last_seq": last_seq,
            "checkpointed_at": now(),
            "write_ts": id_micros(run_key) + last_seq,
        }

    def _check_deltas(self, deltas: Sequence[RunDelta]) -> int | None:
        """Validates a checkpoint's events; returns the first sequence number (None if empty)."""
        if not deltas:
            return None
        bounds = self._config.bounds
        if len(deltas) > bounds.max_checkpoint_deltas:
            raise InvalidArgument(f"at most {bounds.max_checkpoint_deltas} events per checkpoint")
        # One pass over the events (a replica checkpoints every running answer twice a second).
        first = deltas[0].seq
        text_bytes = 0
        for seq, delta in enumerate(deltas, first):
            if delta.seq != seq or first < 1:
                raise InvalidArgument("checkpointed events must have consecutive sequence numbers from 1 up")
            if delta.token_ids and len(delta.token_ids) != delta.token_count:
                raise InvalidArgument("an event's token ids must number its token count")
            text_bytes += len(delta.text) if delta.text.isascii() else len(delta.text.encode())
            text_bytes += len(delta.step) + len(delta.logprobs)
        if text_bytes > bounds.max_checkpoint_bytes:
            raise InvalidArgument(
                f"a checkpoint holds at most {bounds.max_checkpoint_bytes} bytes of text and logprobs"
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
        max_error_chars = self._config.bounds.max_error_message_chars
        if outcome.error_message is not None and len(outcome.error_message) > max_error_chars:
            raise InvalidArgument(f"error message is longer than {max_error_chars} characters")
        run_key = parse_id(run.run_id, "run id")
        usage = outcome.usage
        finished_at = now()
        finish = {
            "status": status.value,
            "finish_reason": unset(outcome.finish_reason and FinishReason(outcome.finish_reason).value),
            "last_seq": outcome.last_seq,
            "finished_at": finished_at,
            "prompt_tokens": unset(usage and usage.prompt_tokens),
            "cached_prompt_tokens": unset(usage and usage.cached_prompt_tokens),
            "completion_tokens": unset(usage and usage.completion_tokens),
            "error_code": unset(outcome.error_code),
            "error_message": unset(outcome.error_message),
            "run_id": run_key,
            "owner_id": run.owner_id,
        }
        statements: list[Write] = [("run_finish", finish)]
        first_seq = self._check_deltas(outcome.tail)
        if first_seq is not None:
            statements.append(("run_tail", _output(run_key, outcome.tail, first_seq)))
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
        usage = [[self._usage.usage_write(final.user_id, final.charge_id, charged)]]
        run_key = parse_id(final.run_id, "run id")
        settled = [[_index_entry("owner_index_delete", final.owner_id, run_key)]]
        message = await self._store_answer(final, stored, usage, settled)
        if message is None:  # no answer stored: the rest goes alone, and clears the chat's active run
            cleared = [self._chats.active_run_cleared(final.user_id, final.chat_id, final.run_id)]
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
        answer = "".join(d.text for d in deltas)
        if not answer and run.status is not RunStatus.COMPLETED:
            return None
        # An answer constrained to tool calls the caller runs is its calls (and the text beside them, if
        # any), under the ids the Responses API gives them (derived from the run's id): docs/tools.md.
        # Any other answer is its text, whatever it looks like (the orchestrator's own steps are events).
        text, calls = parse_answer(answer, run.run_id) if _caller_runs_calls(run) else (answer, [])
        usage = run.usage
        message = Message(
            message_id=run.assistant_message_id,
            chat_id=run.chat_id,
            role=Role.ASSISTANT,
            content=text or "",
            tool_calls=tuple(calls),
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
            chat, _ = await self._chats.with_owner(
                run.user_id, run.chat_id, self._messages.check(message, parent_known=True)
            )
        except NotFound:
            return None  # the chat was deleted while the run went on: nothing to attach the answer to
        cleared = self._chats.active_run_cleared(run.user_id, run.chat_id, run.run_id)
        await self._messages.write(chat, message, [cleared], others, then)
        return message

    async def get_run(self, user_id: str, run_id: str) -> Run:
        check_user(user_id, self._config.bounds)
        run_key = parse_id(run_id, "run id")
        rows = await self._db.execute("run_get", {"run_id": run_key})
        if not rows or rows[0]["user_id"] != user_id or rows[0]["status"] is None:
            raise NotFound(f"run {run_id} not found")
        return _run(run_key, rows[0])

    async def read_run_output(self, user_id: str, run_id: str, after_seq: int = 0) -> list[RunDelta]:
        """The run's stored output events with seq > after_seq (up to the final one once it ended)."""
        check_user(user_id, self._config.bounds)
        run, rows = await self._read_run(parse_id(run_id, "run id"), serial=False)
        if run is None or run.user_id != user_id:
            raise NotFound(f"run {run_id} not found")
        return _deltas(rows, after_seq, run.last_seq if run.status.terminal else None)

    async def _read_run(self, run_key: uuid.UUID, serial: bool) -> tuple[Run | None, list[Row]]:
        # A serial read completes any Paxos round in flight, so it sees who won a finish race.
        consistency = self._db.serial if serial else None
        rows = await self._db.execute("run_read", {"run_id": run_key}, consistency=consistency)
        if not rows or rows[0]["status"] is None:
            return None, rows
        return _run(run_key, rows[0]), rows

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
        return await self.indexed_runs([owner_id], at or now(), max_run_age_s, skip)

    async def indexed_runs(
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

        async def bounded(statement: str, values: dict[str, Any]) -> list[Row]:
            async with limit:
                return await self._db.execute(statement, values)

        scans = await asyncio.gather(
            *(
                bounded("owner_index_scan", {"owner_id": owner, "bucket": bucket})
                for owner in owners
                for bucket in range(first, last + 1)
            )
        )
        run_keys = [
            key
            for key in dict.fromkeys(row["run_id"] for rows in scans for row in rows)
            if not skip(str(key))
        ]
        states = await asyncio.gather(*(bounded("run_get", {"run_id": key}) for key in run_keys))
        return [
            _run(key, rows[0])
            for key, rows in zip(run_keys, states, strict=True)
            if rows and rows[0]["status"] is not None and rows[0]["owner_id"] in owners
        ]


def _caller_runs_calls(run: Run) -> bool:
    """Whether the run's answer was constrained to tool calls its caller runs (its stored request's
    grammar says so; a run stored without its request was not)."""
    if not run.generation:
        return False
    return caller_runs_calls(router_pb2.GenerateStart.FromString(run.generation).sampling.structured.grammar)
