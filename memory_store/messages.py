"""Messages: append, read one, list newest first across buckets, the newest, and branches of the tree.

``messages`` is ``((chat_id, bucket), message_id)`` clustered newest first; ``bucket`` is the day of the
writer-chosen time-sortable id, and ``message_buckets`` lists a chat's non-empty buckets. Appending is
an upsert of the row named by its id: a retried append writes the same row again, never a second one.
The bucket is registered before the message, so an acknowledged message is always reachable.

Cursors hold the last message id returned; the next page is every message older than it, in its
bucket and then in older buckets. Messages appended while a client pages are newer than any cursor, so
pages neither skip nor repeat a message.

A branch (the path from the root to a message) is found by scanning ids and parent ids only, newest
to oldest, following parent links (a parent is always older than its child); then the messages on the
path are fetched whole, one query per bucket.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from memory_store.base import StoreBase, id_str, unset
from memory_store.db import Cql, Row
from memory_store.errors import FailedPrecondition, InvalidArgument, NotFound
from memory_store.ids import id_micros, id_time, parse_id, parse_optional_id
from memory_store.models import Branch, Chat, FinishReason, Message, MessageStatus, Page, Role, Usage
from memory_store.schema import BUCKET_SECONDS

_FULL = (
    "message_id, parent_id, role, content, token_count, model, finish_reason, status, run_id, "
    "prompt_tokens, cached_prompt_tokens, completion_tokens"
)
_LINKS = "message_id, parent_id"
_MAX_BUCKET = 2**31 - 1
_LINK_SCAN_PAGE = 500
_BUCKET_SCAN_PAGE = 32
_KNOWN_BUCKETS_CAPACITY = 100_000

STATEMENTS = {
    "message_insert": Cql(
        "INSERT INTO messages (chat_id, bucket, message_id, parent_id, role, content, token_count, model, "
        "finish_reason, status, run_id, created_at, prompt_tokens, cached_prompt_tokens, completion_tokens) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        idempotent=True,
    ),
    "bucket_insert": Cql("INSERT INTO message_buckets (chat_id, bucket) VALUES (?, ?)", True),
    "buckets_upto": Cql("SELECT bucket FROM message_buckets WHERE chat_id = ? AND bucket <= ? LIMIT ?", True),
    "message_get": Cql(
        f"SELECT {_FULL} FROM messages WHERE chat_id = ? AND bucket = ? AND message_id = ?", True
    ),
    "messages_in": Cql(
        f"SELECT {_FULL} FROM messages WHERE chat_id = ? AND bucket = ? AND message_id IN ?", True
    ),
    "full_newest": Cql(f"SELECT {_FULL} FROM messages WHERE chat_id = ? AND bucket = ? LIMIT ?", True),
    "full_below": Cql(
        f"SELECT {_FULL} FROM messages WHERE chat_id = ? AND bucket = ? AND message_id < ? LIMIT ?", True
    ),
    "links_newest": Cql(f"SELECT {_LINKS} FROM messages WHERE chat_id = ? AND bucket = ? LIMIT ?", True),
    "links_below": Cql(
        f"SELECT {_LINKS} FROM messages WHERE chat_id = ? AND bucket = ? AND message_id < ? LIMIT ?", True
    ),
}


def bucket_of(message_id: uuid.UUID) -> int:
    """The partition bucket of a message: the day (since the Unix epoch) of its id."""
    return id_micros(message_id) // 1_000_000 // BUCKET_SECONDS


def _message(chat_id: str, row: Row) -> Message:
    prompt, cached, completion = row["prompt_tokens"], row["cached_prompt_tokens"], row["completion_tokens"]
    usage = Usage(prompt or 0, cached or 0, completion or 0) if completion is not None else None
    return Message(
        message_id=str(row["message_id"]),
        chat_id=chat_id,
        role=Role(row["role"]),
        content=row["content"] or "",
        parent_id=id_str(row["parent_id"]),
        token_count=row["token_count"] or 0,
        model=row["model"],
        finish_reason=FinishReason(row["finish_reason"]) if row["finish_reason"] else None,
        status=MessageStatus(row["status"]),
        run_id=id_str(row["run_id"]),
        usage=usage,
    )


class MessagesMixin(StoreBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (chat_id, bucket) pairs this process has registered: saves a write per append.
        self._known_buckets: OrderedDict[tuple[uuid.UUID, int], None] = OrderedDict()

    async def append_message(self, user_id: str, message: Message) -> Message:
        """Stores a message (an upsert of its id) and moves the chat to the top of the user's list.

        The id is chosen by the writer (``ids.new_id()``); the parent must already be in the chat and
        be older. Content is bounded by ``Limits`` (32 KiB for user messages).
        """
        max_bytes = (
            self.limits.max_user_content_bytes
            if message.role is Role.USER
            else self.limits.max_assistant_content_bytes
        )
        if len(message.content.encode()) > max_bytes:
            raise InvalidArgument(f"message content is larger than {max_bytes} bytes")
        chat = await self._owned_chat(user_id, message.chat_id)
        await self._store_message(chat, message)
        await self._touch(chat, [])
        return message

    async def _store_message(self, chat: Chat, message: Message) -> None:
        """Validates the message's shape and parent, registers its bucket, and writes it."""
        message_id = parse_id(message.message_id, "message id")
        parent_id = parse_optional_id(message.parent_id, "parent id")
        run_id = parse_optional_id(message.run_id, "run id")
        role = Role(message.role)
        if message.token_count < 0:
            raise InvalidArgument("token count must not be negative")
        if message.model is not None and len(message.model) > self.limits.max_model_chars:
            raise InvalidArgument(f"model name is longer than {self.limits.max_model_chars} characters")
        made = id_time(message_id)
        if made > datetime.now(UTC) + timedelta(seconds=self.limits.max_id_clock_skew_s):
            raise InvalidArgument("message id lies in the future; make ids with memory_store.ids.new_id()")
        chat_key = uuid.UUID(chat.chat_id)
        if parent_id is not None:
            if parent_id.time >= message_id.time:
                raise FailedPrecondition("a message's parent must be older than the message")
            if await self._message_row(chat_key, parent_id) is None:
                raise FailedPrecondition(f"parent message {parent_id} is not in chat {chat.chat_id}")
        bucket = bucket_of(message_id)
        await self._register_bucket(chat_key, bucket)
        usage = message.usage
        await self._db.execute(
            "message_insert",
            (
                chat_key,
                bucket,
                message_id,
                unset(parent_id),
                role.value,
                message.content,
                message.token_count,
                unset(message.model),
                unset(message.finish_reason and FinishReason(message.finish_reason).value),
                MessageStatus(message.status).value,
                unset(run_id),
                made,
                unset(usage and usage.prompt_tokens),
                unset(usage and usage.cached_prompt_tokens),
                unset(usage and usage.completion_tokens),
            ),
        )

    async def _register_bucket(self, chat_key: uuid.UUID, bucket: int) -> None:
        key = (chat_key, bucket)
        if key in self._known_buckets:
            self._known_buckets.move_to_end(key)
            return
        await self._db.execute("bucket_insert", key)
        self._known_buckets[key] = None
        if len(self._known_buckets) > _KNOWN_BUCKETS_CAPACITY:
            self._known_buckets.popitem(last=False)

    async def get_message(self, user_id: str, chat_id: str, message_id: str) -> Message:
        chat = await self._owned_chat(user_id, chat_id)
        row = await self._message_row(uuid.UUID(chat.chat_id), parse_id(message_id, "message id"))
        if row is None:
            raise NotFound(f"message {message_id} not found")
        return _message(chat.chat_id, row)

    async def _message_row(self, chat_key: uuid.UUID, message_id: uuid.UUID) -> Row | None:
        rows = await self._db.execute("message_get", (chat_key, bucket_of(message_id), message_id))
        return rows[0] if rows else None

    async def list_messages(
        self, user_id: str, chat_id: str, before: str | None = None, limit: int | None = None
    ) -> Page[Message]:
        """A page of the chat's messages (every branch), newest first; ``before`` is a page cursor."""
        limit = self._page_size(limit, 50, self.limits.max_message_page)
        below = None
        if before:
            position = self._cursors.decode(before, "messages", f"{user_id}/{chat_id}")
            below = parse_id(str(position[0]), "page token")
        chat_key = parse_id(chat_id, "chat id")

        async def collect() -> list[Row]:
            rows: list[Row] = []
            async for row in self._scan(chat_key, below, "full", limit + 1):
                rows.append(row)
                if len(rows) > limit:
                    break
            return rows

        # The ownership check and the first reads run together; nothing is returned unless it passes.
        chat, rows = await asyncio.gather(self._owned_chat(user_id, chat_id), collect())
        items = [_message(chat.chat_id, row) for row in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            next_cursor = self._cursors.encode("messages", f"{user_id}/{chat_id}", [items[-1].message_id])
        return Page(items=items, next_cursor=next_cursor)

    async def get_latest_message(self, user_id: str, chat_id: str) -> Message | None:
        """The chat's newest message on any branch, or None for an empty chat."""
        chat_key = parse_id(chat_id, "chat id")

        async def newest() -> Row | None:
            async for row in self._scan(chat_key, None, "full", 1):
                return row
            return None

        chat, row = await asyncio.gather(self._owned_chat(user_id, chat_id), newest())
        return _message(chat.chat_id, row) if row is not None else None

    async def get_branch(
        self,
        user_id: str,
        chat_id: str,
        message_id: str,
        *,
        stop_at: str | None = None,
        max_messages: int | None = None,
    ) -> Branch:
        """The path from the root to ``message_id``, oldest first: what a prompt is assembled from.

        At most ``max_messages`` messages (the newest ones of the path) are returned; the walk also
        stops before ``stop_at`` (e.g. the newest message a summary covers), so the result is what
        comes after it.
        """
        limit = self._page_size(
            max_messages, self.limits.max_branch_messages, self.limits.max_branch_messages
        )
        leaf_id = parse_id(message_id, "message id")
        stop = parse_optional_id(stop_at, "stop_at")
        chat = await self._owned_chat(user_id, chat_id)
        chat_key = uuid.UUID(chat.chat_id)
        leaf = await self._message_row(chat_key, leaf_id)
        if leaf is None:
            raise NotFound(f"message {message_id} not found")
        if leaf_id == stop:
            return Branch(messages=[], truncated=True, reached_stop=True)
        path = [leaf_id]
        target = leaf["parent_id"]
        reached_stop = False
        if target is not None and len(path) < limit:
            async for row in self._scan(chat_key, leaf_id, "links", _LINK_SCAN_PAGE):
                if row["message_id"] != target:
                    continue
                if target == stop:
                    reached_stop = True
                    break
                path.append(target)
                target = row["parent_id"]
                if target is None or len(path) >= limit:
                    break
        rows = {leaf_id: leaf, **await self._fetch_many(chat_key, path[1:])}
        messages = [_message(chat.chat_id, rows[mid]) for mid in reversed(path) if mid in rows]
        return Branch(messages=messages, truncated=target is not None, reached_stop=reached_stop)

    async def _fetch_many(self, chat_key: uuid.UUID, ids: list[uuid.UUID]) -> dict[uuid.UUID, Row]:
        """Whole rows of ``ids``, one query per bucket."""
        by_bucket: dict[int, list[uuid.UUID]] = defaultdict(list)
        for message_id in ids:
            by_bucket[bucket_of(message_id)].append(message_id)
        results = await asyncio.gather(
            *(self._db.execute("messages_in", (chat_key, b, group)) for b, group in by_bucket.items())
        )
        return {row["message_id"]: row for rows in results for row in rows}

    async def _scan(
        self, chat_key: uuid.UUID, below: uuid.UUID | None, columns: str, page: int
    ) -> AsyncIterator[Row]:
        """Rows of the chat older than ``below`` (all if None), newest first, across buckets.

        ``columns`` is "full" or "links"; ``page`` rows are read per query.
        """
        bucket_cap = bucket_of(below) if below is not None else _MAX_BUCKET
        while True:
            buckets = await self._db.execute("buckets_upto", (chat_key, bucket_cap, _BUCKET_SCAN_PAGE))
            for entry in buckets:
                bucket = entry["bucket"]
                cursor = below if below is not None and bucket == bucket_of(below) else None
                while True:
                    if cursor is None:
                        rows = await self._db.execute(f"{columns}_newest", (chat_key, bucket, page))
                    else:
                        rows = await self._db.execute(f"{columns}_below", (chat_key, bucket, cursor, page))
                    for row in rows:
                        yield row
                    if len(rows) < page:
                        break
                    cursor = rows[-1]["message_id"]
            if len(buckets) < _BUCKET_SCAN_PAGE:
                return
            bucket_cap = buckets[-1]["bucket"] - 1
