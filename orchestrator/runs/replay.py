"""A run's events rebuilt from Cassandra, for streams on a replica that does not hold the run in memory.

The generating replica numbers events ``started`` = 1, one per delta, then ``usage`` and ``done`` (or
one ``error``), and checkpoints every delta with its sequence number (and its tokens' logprobs, where
the run asked for them). From the stored run and its deltas, any replica rebuilds exactly the same
events for a run its owner finished: started from the run's ids, the deltas as stored, and the
terminal events right after the last delta.

A run ended by someone else (a cancel on another replica, or interruption after its replica was lost)
may have streamed deltas that were never checkpointed; its terminal events then follow the last
stored delta, or the client's ``after_seq`` if that is further, so a client that saw more still gets
the end of the run and never a repeated sequence number.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence

from chatmesh.chat.v1 import chat_pb2
from chatmesh.run_events import MAX_MERGED_DELTAS, merged_delta
from memory_store.models import Run, RunDelta, RunStatus
from memory_store.store import MemoryStore
from orchestrator import convert
from orchestrator.runs.checkpoints import decoded_logprobs
from orchestrator.runs.tool_steps import step_event

INTERRUPTED_CODE = "ABORTED"
INTERRUPTED_MESSAGE = (
    "the replica generating this answer was lost; the part generated until then is kept. "
    "Regenerate the answer to get a complete one"
)


def started_event(run: Run) -> chat_pb2.RunEvent:
    return chat_pb2.RunEvent(
        seq=1,
        started=chat_pb2.RunStarted(
            run_id=run.run_id,
            chat_id=run.chat_id,
            user_message_id=run.user_message_id or "",
            assistant_message_id=run.assistant_message_id,
            model=run.model,
        ),
    )


def terminal_events(run: Run, deltas: Sequence[RunDelta], after_seq: int) -> list[chat_pb2.RunEvent]:
    """The events with seq > after_seq that end a finished run."""
    last_delta = deltas[-1].seq if deltas else 1
    kinds: list[dict] = []
    if run.status is RunStatus.INTERRUPTED:
        kinds.append({"error": chat_pb2.RunError(code=INTERRUPTED_CODE, message=INTERRUPTED_MESSAGE)})
    elif run.status is RunStatus.FAILED:
        kinds.append(
            {"error": chat_pb2.RunError(code=run.error_code or "UNKNOWN", message=run.error_message or "")}
        )
    else:
        if run.usage is not None:
            kinds.append({"usage": convert.usage(run.usage)})
        stored = any(d.text for d in deltas) or run.status is RunStatus.COMPLETED
        done = chat_pb2.Done(
            finish_reason=convert.finish_reason(run.finish_reason),
            assistant_message_id=run.assistant_message_id if stored else "",
        )
        kinds.append({"done": done})
    base = last_delta
    if run.last_seq < last_delta + len(kinds):
        # Ended without its owner (whose last_seq always covers its terminal events): the client may
        # have seen deltas that were never checkpointed.
        base = max(last_delta, after_seq)
    events = [chat_pb2.RunEvent(seq=base + i + 1, **kind) for i, kind in enumerate(kinds)]
    return [event for event in events if event.seq > after_seq]


def _batches(events: Sequence[RunDelta], most: int) -> Iterator[list[RunDelta]]:
    """Consecutive text events, up to ``most`` at a time, and each tool step alone."""
    batch: list[RunDelta] = []
    for event in events:
        if event.step or len(batch) == most:
            if batch:
                yield batch
            batch = []
        if event.step:
            yield [event]
        else:
            batch.append(event)
    if batch:
        yield batch


async def follow_stored(
    store: MemoryStore, user_id: str, run: Run, after_seq: int, poll_s: float, merge_deltas: bool = False
) -> AsyncIterator[chat_pb2.RunEvent]:
    """Events with seq > after_seq of a run this replica does not hold: replayed from its checkpoints,
    followed while its owner (elsewhere) keeps checkpointing, until the run ends. With
    ``merge_deltas``, the deltas each read finds come merged (``MAX_MERGED_DELTAS`` at most in one)."""
    position = after_seq
    if position < 1:
        yield started_event(run)
        position = 1
    while True:
        ended = run.status.terminal
        deltas = await store.read_run_output(user_id, run.run_id, after_seq=0)
        fresh = [delta for delta in deltas if delta.seq > position]
        for batch in _batches(fresh, MAX_MERGED_DELTAS if merge_deltas else 1):
            position = batch[-1].seq
            if batch[0].step:
                yield chat_pb2.RunEvent(seq=position, **step_event(batch[0].step))
            else:
                logprobs = [lp for delta in batch for lp in decoded_logprobs(delta.logprobs)]
                yield merged_delta(position, [(delta.text, delta.token_count) for delta in batch], logprobs)
        if ended:
            for event in terminal_events(run, deltas, position):
                yield event
            return
        await asyncio.sleep(poll_s)
        run = await store.get_run(user_id, run.run_id)
