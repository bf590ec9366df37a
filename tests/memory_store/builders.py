"""Small builders for memory_store tests: unique users, messages, a chat with a run and its output; and
the requests the store sent, counted."""

from __future__ import annotations

import collections
import uuid
from collections.abc import Sequence
from datetime import datetime

from memory_store.db import OPERATION_SECONDS
from memory_store.ids import new_id
from memory_store.models import Message, NewRun, Role, Run, RunDelta
from memory_store.store import MemoryStore


def new_user() -> str:
    """A user id no other test uses, so tests share one keyspace without seeing each other's data."""
    return f"user-{uuid.uuid4().hex[:12]}"


def message(
    chat_id: str,
    content: str,
    parent: Message | None = None,
    role: Role = Role.USER,
    at: datetime | None = None,
    message_id: str | None = None,
) -> Message:
    return Message(
        message_id=message_id or str(new_id(at)),
        chat_id=chat_id,
        role=role,
        content=content,
        parent_id=parent.message_id if parent else None,
    )


async def regenerated_tree(store: MemoryStore, user: str, chat_id: str) -> dict[str, Message]:
    """q1, its answer a1 and a regenerated sibling of it, then q2 and a2 after the regenerated one; by
    content."""
    stored: dict[str, Message] = {}
    for content, parent, role in [
        ("q1", None, Role.USER),
        ("a1", "q1", Role.ASSISTANT),
        ("a1 regenerated", "q1", Role.ASSISTANT),
        ("q2", "a1 regenerated", Role.USER),
        ("a2", "q2", Role.ASSISTANT),
    ]:
        stored[content] = await store.append_message(
            user, message(chat_id, content, stored.get(parent or ""), role)
        )
    return stored


async def start_run(
    store: MemoryStore,
    user: str,
    chat_id: str,
    question: str,
    parent: Message | None = None,
    owner: str = "replica-a",
    prompt_tokens: int = 0,
    generation: bytes = b"",
) -> tuple[Run, Message]:
    """Claims a key, stores the user message and opens a run answering it: what a send does."""
    claim = await store.claim_idempotency_key(user, f"key-{uuid.uuid4().hex}", b"fingerprint")
    asked = await store.append_message(
        user, message(chat_id, question, parent, message_id=claim.user_message_id)
    )
    run = await store.create_run(
        NewRun(
            user,
            chat_id,
            run_id=claim.run_id,
            parent_message_id=asked.message_id,
            assistant_message_id=claim.assistant_message_id,
            model="smollm2-135m",
            owner_id=owner,
            user_message_id=asked.message_id,
            prompt_tokens=prompt_tokens,
            generation=generation,
        )
    )
    return run, asked


async def checkpoint(store: MemoryStore, run: Run, deltas: Sequence[RunDelta]) -> None:
    """Stores a run's output events as its owner's checkpoint writer does (``checkpoint_runs``)."""
    assert await store.checkpoint_runs([(run, deltas)]) == [True], "the checkpoint was not stored"


def operations_counted() -> collections.Counter[str]:
    """How many requests of each name the store has sent to Cassandra (its duration histogram's counts)."""
    counted: collections.Counter[str] = collections.Counter()
    for metric in OPERATION_SECONDS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):  # one sample per name and error type
                counted[sample.labels["db_operation_name"]] += sample.value
    return counted


def requests_sent(before: collections.Counter[str]) -> collections.Counter[str]:
    """The requests sent since ``before`` (``operations_counted()``), by name."""
    return operations_counted() - before
