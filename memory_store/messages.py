"""Messages: append, read one, list newest first across buckets, and branches of the tree (ending at a
message, or at the chat's newest).

``messages`` is ``((chat_id, bucket), message_id)`` clustered newest first; ``bucket`` is the day of the
writer-chosen time-sortable id, and ``message_buckets`` lists a chat's non-empty buckets. Appending is
an upsert of the row named by its id: a retried append writes the same row again, never a second one.
The bucket is registered with the message, and an append is acknowledged only once both are stored, so
an acknowledged message is always reachable.

Cursors hold the last message id returned; the next page is every message older than it, in its
bucket and then in older buckets. Messages appended while a client pages are newer than any cursor, so
pages neither skip nor repeat a message.

A branch (the path from the root to a message) is read in one pass over the chat, newest to oldest,
following parent links: a parent is always older than its child, so the walk never goes back. A page of
a branch (``branch_page``) jumps instead: each query starts at the path's next message.

``message_children`` holds the tree's edges, a parent's children side by side: a branch page reads its
messages' versions (their siblings) in one query, and the newest message under one (the leaf a client
switching versions opens) in one pass over the edges newer than it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from chatmesh.finish import FinishReason, Usage
from chatmesh.tool_format import ToolCall
from memory_store.base import check_fingerprint, id_str, page_size, unset
from memory_store.chats import Chats
from memory_store.config import StoreConfig
from memory_store.cursor import CursorCodec
from memory_store.db import Cql, Db, Row, Write
from memory_store.errors import FailedPrecondition, InvalidArgument, NotFound
from memory_store.ids import id_micros, id_time, new_id, parse_id, parse_optional_id
from memory_store.models import (
    UNKNOWN_VERSIONS,
    Branch,
    BranchPage,
    Chat,
    ChatSummary,
    Message,
    MessageStatus,
    Page,
    Role,
    Versions,
)
from memory_store.schema import BUCKET_SECONDS
from memory_store.search_index import index_write, item_delete_write

_FULL = (
    "message_id, parent_id, role, content, token_count, model, finish_reason, status, run_id, "
    "prompt_tokens, cached_prompt_tokens, completion_tokens, tokenizer_fingerprint, tool_calls, tool_call_id, "
    "tool_name"
)
_MAX_BUCKET = 2**31 - 1
_MIN_BRANCH_PAGE = 32
_MAX_BRANCH_PAGE = 256
_BUCKET_SCAN_PAGE = 32
_KNOWN_BUCKETS_CAPACITY = 100_000
# A tool call's id and function name (ours: chatmesh.tool_format's call ids, functions' names).
_MAX_TOOL_NAME_CHARS = 256
_CHILDREN_PAGE = 1000

_IN_BUCKET = "chat_id = :chat_id AND bucket = :bucket"

STATEMENTS = {
    "message_insert": Cql(
        "INSERT INTO messages (chat_id, bucket, message_id, parent_id, role, content, token_count, model, "
        "finish_reason, status, run_id, created_at, prompt_tokens, cached_prompt_tokens, completion_tokens, "
        "tokenizer_fingerprint, tool_calls, tool_call_id, tool_name) VALUES (:chat_id, :bucket, :message_id, "
        ":parent_id, :role, :content, :token_count, :model, :finish_reason, :status, :run_id, :created_at, "
        ":prompt_tokens, :cached_prompt_tokens, :completion_tokens, :tokenizer_fingerprint, :tool_calls, "
        ":tool_call_id, :tool_name)",
        idempotent=True,
    ),
    "bucket_insert": Cql("INSERT INTO message_buckets (chat_id, bucket) VALUES (:chat_id, :bucket)", True),
    "buckets_upto": Cql(
        "SELECT bucket FROM message_buckets WHERE chat_id = :chat_id AND bucket <= :bucket LIMIT :rows", True
    ),
    # An item deleted from a conversation: its children follow its parent (messages.delete_message).
    "message_reparent": Cql(
        f"UPDATE messages SET parent_id = :parent_id WHERE {_IN_BUCKET} AND message_id = :message_id", True
    ),
    "message_delete": Cql(f"DELETE FROM messages WHERE {_IN_BUCKET} AND message_id = :message_id", True),
    "message_get": Cql(f"SELECT {_FULL} FROM messages WHERE {_IN_BUCKET} AND message_id = :message_id", True),
    "messages_newest": Cql(f"SELECT {_FULL} FROM messages WHERE {_IN_BUCKET} LIMIT :rows", True),
    "messages_upto": Cql(
        f"SELECT {_FULL} FROM messages WHERE {_IN_BUCKET} AND message_id <= :message_id LIMIT :rows", True
    ),
    "messages_below": Cql(
        f"SELECT {_FULL} FROM messages WHERE {_IN_BUCKET} AND message_id < :message_id LIMIT :rows", True
    ),
    "child_insert": Cql(
        "INSERT INTO message_children (chat_id, parent_id, message_id) VALUES (:chat_id, :parent_id, :message_id)",
        True,
    ),
    "child_delete": Cql(
        "DELETE FROM message_children WHERE chat_id = :chat_id AND parent_id = :parent_id AND message_id = :message_id",
        True,
    ),
    "children_of": Cql(
        "SELECT parent_id, message_id FROM message_children WHERE chat_id = :chat_id AND parent_id IN :parents",
        True,
    ),
    "children_after": Cql(
        "SELECT parent_id, message_id FROM message_children WHERE chat_id = :chat_id"
        " AND (parent_id, message_id) > (:parent_id, :message_id) LIMIT :rows",
        True,
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
        tokenizer_fingerprint=row["tokenizer_fingerprint"] or "",
        tool_calls=tuple(ToolCall(**call) for call in json.loads(row["tool_calls"] or "[]")),
        tool_call_id=row["tool_call_id"],
        tool_name=row["tool_name"],
    )


def _calls_json(calls: Sequence[ToolCall]) -> str | None:
    """An answer's tool calls as the ``tool_calls`` column holds them (None: no call)."""
    return (
        json.dumps([{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]) if calls else None
    )


def _check_tools(message: Message) -> None:
    """Only an answer calls tools, and a tool message (only) names the call it is the result of."""
    if message.tool_calls and message.role is not Role.ASSISTANT:
        raise InvalidArgument("only an assistant message calls tools")
    if (message.role is Role.TOOL) != (message.tool_call_id is not None):
        raise InvalidArgument("a tool message names the call it answers, and no other message does")
    names = [message.tool_call_id or "", message.tool_name or ""]
    names += [part for call in message.tool_calls for part in (call.id, call.name)]
    if any(len(name) > _MAX_TOOL_NAME_CHARS for name in names):
        raise InvalidArgument(f"a tool call's id and name are at most {_MAX_TOOL_NAME_CHARS} characters")


class Messages:
    """A chat's messages (``messages``, in day buckets that ``message_buckets`` lists) and its branches."""

    def __init__(self, db: Db, config: StoreConfig, cursors: CursorCodec, chats: Chats) -> None:
        self._db = db
        self._config = config
        self._cursors = cursors
        self._chats = chats
        # (chat_id, bucket) pairs this process has registered: saves a write per append.
        self._known_buckets: OrderedDict[tuple[uuid.UUID, int], None] = OrderedDict()

    async def append_message(self, user_id: str, message: Message) -> Message:
        """Stores a message (an upsert of its id) and moves the chat to the top of the user's list.

        The id is chosen by the writer (``ids.new_id()``); the parent must already be in the chat and
        be older. User content is bounded by ``limits.max_message_bytes``, answers by ``bounds``.
        """
        self.check_size(message)
        chat, _ = await self._chats.with_owner(user_id, message.chat_id, self.check(message))
        await self.write(chat, message)
        return message

    def check_size(self, message: Message) -> None:
        """Refuses content over its role's bound."""
        max_bytes = (
            self._config.bounds.max_assistant_content_bytes
            if message.role is Role.ASSISTANT
            else self._config.limits.max_message_bytes
        )
        if len(message.content.encode()) > max_bytes:
            raise InvalidArgument(f"message content is larger than {max_bytes} bytes")

    async def check(self, message: Message, parent_known: bool = False) -> None:
        """Validates the message's fields, and that its parent is an older message of the chat (read
        unless the caller read it in this same request: ``parent_known``)."""
        chat_key = parse_id(message.chat_id, "chat id")
        message_id = parse_id(message.message_id, "message id")
        parent_id = parse_optional_id(message.parent_id, "parent id")
        parse_optional_id(message.run_id, "run id")
        if message.role not in tuple(Role) or message.status not in tuple(MessageStatus):
            raise InvalidArgument(f"unknown role {message.role!r} or status {message.status!r}")
        if message.token_count < 0:
            raise InvalidArgument("token count must not be negative")
        _check_tools(message)
        max_model_chars = self._config.limits.max_model_chars
        if message.model is not None and len(message.model) > max_model_chars:
            raise InvalidArgument(f"model name is longer than {max_model_chars} characters")
        check_fingerprint(message.tokenizer_fingerprint, self._config.bounds)
        skew = timedelta(seconds=self._config.bounds.max_id_clock_skew_s)
        if id_time(message_id) > datetime.now(UTC) + skew:
            raise InvalidArgument("message id lies in the future; make ids with memory_store.ids.new_id()")
        if parent_id is None:
            return
        if parent_id.time >= message_id.time:
            raise FailedPrecondition("a message's parent must be older than the message")
        if not parent_known:
            await self.check_parent(chat_key, parent_id)

    async def check_parent(self, chat_key: uuid.UUID, parent_id: uuid.UUID) -> None:
        """FAILED_PRECONDITION unless ``parent_id`` is a message of the chat."""
        if await self._message_row(chat_key, parent_id) is None:
            raise FailedPrecondition(f"message {parent_id} is not in chat {chat_key}")

    async def write(
        self,
        chat: Chat,
        message: Message,
        extra: Sequence[Write] = (),
        others: Sequence[Sequence[Write]] = (),
        then: Sequence[Sequence[Write]] = (),
    ) -> None:
        """Writes a checked message and moves its chat to the top of the owner's list (with ``extra``,
        more writes to the owner's partition, in the same mutation; with ``others``, groups of writes to
        other partitions, in the same request where they fit; ``then``, groups never acknowledged
        without the rest: ``Db.write``).

        The bucket is registered with the message, and the write is acknowledged only once both are
        stored, so an acknowledged message is always reachable (a message whose bucket failed to
        register was not acknowledged: its retry registers it; a bucket registered for a write that
        then fails stays empty and costs nothing).
        """
        await self._db.write(
            [*self.writes(chat, message, extra), *others], self._config.max_batch_bytes, then
        )
        self.bucket_registered(chat, message)

    def writes(
        self, chat: Chat, message: Message, extra: Sequence[Write] = (), touch: bool = True
    ) -> list[list[Write]]:
        """What stores a checked message, in groups that each land at once (one partition each): its
        bucket's registration (unless known to be registered), its row, and in the owner's partition
        its search entry with the chat's activity (unless not ``touch``: a message stored with a newer
        one that does) and ``extra``, more writes to the owner's partition. Once written, call
        ``bucket_registered``."""
        chat_key = uuid.UUID(chat.chat_id)
        message_id = uuid.UUID(message.message_id)
        bucket = bucket_of(message_id)
        usage = message.usage
        role = Role(message.role).value
        insert: Write = (
            "message_insert",
            {
                "chat_id": chat_key,
                "bucket": bucket,
                "message_id": message_id,
                "parent_id": unset(message.parent_id and uuid.UUID(message.parent_id)),
                "role": role,
                "content": message.content,
                "token_count": message.token_count,
                "model": unset(message.model),
                "finish_reason": unset(message.finish_reason and FinishReason(message.finish_reason).value),
                "status": MessageStatus(message.status).value,
                "run_id": unset(message.run_id and uuid.UUID(message.run_id)),
                "created_at": id_time(message_id),
                "prompt_tokens": unset(usage and usage.prompt_tokens),
                "cached_prompt_tokens": unset(usage and usage.cached_prompt_tokens),
                "completion_tokens": unset(usage and usage.completion_tokens),
                "tokenizer_fingerprint": unset(message.tokenizer_fingerprint or None),
                "tool_calls": unset(_calls_json(message.tool_calls)),
                "tool_call_id": unset(message.tool_call_id),
                "tool_name": unset(message.tool_name),
            },
        )
        searchable = index_write(chat.user_id, chat_key, message_id, role, message.content)
        # The search entry lives in the owner's partition, as the chat's activity does: one mutation.
        owners = self._chats.touch_writes(chat, [searchable, *extra])[0] if touch else [searchable, *extra]
        # Under its parent in the chat's tree (a first message under the chat's own id).
        child: Write = (
            "child_insert",
            {
                "chat_id": chat_key,
                "parent_id": _parent_key(chat_key, message.parent_id),
                "message_id": message_id,
            },
        )
        writes: list[list[Write]] = [[insert], owners, [child]]
        if (chat_key, bucket) not in self._known_buckets:
            writes.append([("bucket_insert", {"chat_id": chat_key, "bucket": bucket})])
        return writes

    def bucket_registered(self, chat: Chat, message: Message) -> None:
        """Remembers that the message's bucket is registered (its write succeeded)."""
        key = (uuid.UUID(chat.chat_id), bucket_of(uuid.UUID(message.message_id)))
        self._known_buckets[key] = None
        self._known_buckets.move_to_end(key)
        if len(self._known_buckets) > _KNOWN_BUCKETS_CAPACITY:
            self._known_buckets.popitem(last=False)

    async def get_message(self, user_id: str, chat_id: str, message_id: str) -> Message:
        chat_key, key = parse_id(chat_id, "chat id"), parse_id(message_id, "message id")
        chat, row = await self._chats.with_owner(user_id, chat_id, self._message_row(chat_key, key))
        if row is None:
            raise NotFound(f"message {message_id} not found")
        return _message(chat.chat_id, row)

    async def _message_row(self, chat_key: uuid.UUID, message_id: uuid.UUID) -> Row | None:
        rows = await self._db.execute(
            "message_get", {"chat_id": chat_key, "bucket": bucket_of(message_id), "message_id": message_id}
        )
        return rows[0] if rows else None

    async def delete_message(self, user_id: str, chat_id: str, message_id: str) -> None:
        """Takes one message out of the chat's tree: its children (newer messages, read here) follow its
        parent instead, its search entry goes, and the chat's rolling summary, which may hold what it
        said, is dropped (the next long prompt summarises anew), all in one logged batch. NOT_FOUND for
        a message not in the chat; FAILED_PRECONDITION while a run of the chat is in progress (its
        answer is parented on a message of the tree)."""
        chat_key, key = parse_id(chat_id, "chat id"), parse_id(message_id, "message id")
        chat, row = await self._chats.with_owner(user_id, chat_id, self._message_row(chat_key, key))
        if row is None:
            raise NotFound(f"message {message_id} not found")
        if chat.active_run_id:
            raise FailedPrecondition(f"chat {chat_id} has an answer in progress; wait for it to end")
        # The tree's edges (message_children) move with the messages: the deleted one's goes, and each
        # child's moves under the deleted message's parent.
        parent = _parent_key(chat_key, row["parent_id"])
        writes: list[Write] = [
            ("message_delete", {"chat_id": chat_key, "bucket": bucket_of(key), "message_id": key}),
            ("child_delete", {"chat_id": chat_key, "parent_id": parent, "message_id": key}),
        ]
        async for newer in self._scan(chat_key, None, _MAX_BRANCH_PAGE):
            if newer["message_id"].time <= key.time:
                break
            if newer["parent_id"] == key:
                child = newer["message_id"]
                where = {"chat_id": chat_key, "bucket": bucket_of(child), "message_id": child}
                writes.append(("message_reparent", {**where, "parent_id": row["parent_id"]}))
                writes.append(("child_delete", {"chat_id": chat_key, "parent_id": key, "message_id": child}))
                writes.append(
                    ("child_insert", {"chat_id": chat_key, "parent_id": parent, "message_id": child})
                )
        writes += [item_delete_write(user_id, chat_key, key), self._chats.summary_dropped(chat_key)]
        await self._db.execute_batch(writes)

    async def list_messages(
        self, user_id: str, chat_id: str, before: str | None = None, limit: int | None = None
    ) -> Page[Message]:
        """A page of the chat's messages (every branch), newest first; ``before`` is a page cursor."""
        limits = self._config.limits
        limit = page_size(limit, limits.default_message_page, limits.max_message_page)
        below = None
        if before:
            position = self._cursors.decode(before, "messages", f"{user_id}/{chat_id}")
            below = parse_id(str(position[0]), "page token")
        chat_key = parse_id(chat_id, "chat id")

        async def collect() -> list[Row]:
            rows: list[Row] = []
            async for row in self._scan(chat_key, below, limit + 1):
                rows.append(row)
                if len(rows) > limit:
                    break
            return rows

        chat, rows = await self._chats.with_owner(user_id, chat_id, collect())
        items = [_message(chat.chat_id, row) for row in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            next_cursor = self._cursors.encode("messages", f"{user_id}/{chat_id}", [items[-1].message_id])
        return Page(items=items, next_cursor=next_cursor)

    async def get_branch(
        self,
        user_id: str,
        chat_id: str,
        message_id: str | None,
        *,
        max_messages: int | None = None,
        with_summary: bool = False,
    ) -> Branch:
        """The path from the root to ``message_id`` (None: the chat's newest message; an empty chat has
        an empty path), oldest first: what a prompt is assembled from.

        At most ``max_messages`` messages (the newest ones of the path) are returned. ``with_summary``
        reads the chat's summary too, in the same round trip and under the same ownership check.
        """
        most = self._config.bounds.max_branch_messages
        limit = page_size(max_messages, most, most)
        chat_key = parse_id(chat_id, "chat id")
        leaf_id = parse_optional_id(message_id, "message id")
        # Whole rows, newest first from the leaf itself: most rows before a leaf are on its path, so
        # pages a little longer than the path usually read the whole branch in one query.
        page = min(max(2 * limit, _MIN_BRANCH_PAGE), _MAX_BRANCH_PAGE)

        async def walk() -> tuple[list[Row], uuid.UUID | None]:
            path: list[Row] = []
            target: uuid.UUID | None = leaf_id  # the next message on the path
            async for row in self._scan(chat_key, leaf_id, page, include_start=True):
                if not path and target is None:
                    target = row["message_id"]  # the newest message is the leaf
                if not path and target == leaf_id and row["message_id"] != leaf_id:
                    break  # the leaf is not in the chat
                if row["message_id"] != target:
                    continue
                path.append(row)
                target = row["parent_id"]
                if target is None or len(path) >= limit:
                    break
            return path, target

        async def read() -> tuple[tuple[list[Row], uuid.UUID | None], ChatSummary | None]:
            if not with_summary:
                return await walk(), None
            return await asyncio.gather(walk(), self._chats.summary(chat_key))

        chat, ((path, target), summary) = await self._chats.with_owner(user_id, chat_id, read())
        if not path and leaf_id is not None:
            raise NotFound(f"message {message_id} not found")
        messages = [_message(chat.chat_id, row) for row in reversed(path)]
        return Branch(messages, chat, truncated=target is not None, summary=summary)

    async def branch_page(
        self,
        user_id: str,
        chat_id: str,
        leaf_id: str | None,
        after: str | None,
        limit: int | None = None,
        newest_under: bool = False,
    ) -> BranchPage:
        """A page of the path that ends at ``leaf_id`` (None: the chat's newest message), leaf first,
        with each message's versions; ``after`` is a page cursor of the same request (it holds the next
        message of the path). ``newest_under``: the path ends at the newest message under ``leaf_id``
        instead (itself if none, or if the edges under it were stored before ``message_children``).

        Each query starts at the path's next message and reads as many rows as the page still needs,
        in that message's bucket (known from its id: no bucket list is read). A branch stored without
        other branches in between costs one query of ``limit`` rows per page (plus one per day
        boundary it crosses); a stretch of other branches' messages between two of the path's costs at
        most one more query, started at the path's next message. The chat's newest message, when it is
        the leaf, is found as ``list_messages`` finds it (the bucket list and today's bucket at once).
        """
        limits = self._config.limits
        limit = page_size(limit, limits.default_message_page, limits.max_message_page)
        chat_key = parse_id(chat_id, "chat id")
        leaf_key = parse_optional_id(leaf_id, "message id")
        if newest_under and leaf_key is None:
            raise InvalidArgument("the newest message under a message needs that message")
        scope = f"{user_id}/{chat_id}/{leaf_id or ''}{'/newest' if newest_under else ''}"
        start = leaf_key
        if after:
            start = parse_id(str(self._cursors.decode(after, "branch", scope)[0]), "page token")
        descend = newest_under and not after
        chat, (path, following) = await self._chats.with_owner(
            user_id, chat_id, self._walk(chat_key, start, limit, descend)
        )
        if not path and (start is not None):
            raise NotFound(f"message {leaf_id} not found")
        next_cursor = self._cursors.encode("branch", scope, [str(following)]) if following else None
        return BranchPage(
            items=[_message(chat.chat_id, row) for row in path],
            next_cursor=next_cursor,
            versions=await self._versions(chat_key, path),
        )

    async def _versions(self, chat_key: uuid.UUID, path: list[Row]) -> list[Versions]:
        """Each row's versions: its parent's children (one query of the chat's tree partition)."""
        if not path:
            return []
        parents = sorted({_parent_key(chat_key, row["parent_id"]) for row in path}, key=lambda key: key.time)
        children: dict[uuid.UUID, list[uuid.UUID]] = {}
        for edge in await self._db.execute("children_of", {"chat_id": chat_key, "parents": parents}):
            children.setdefault(edge["parent_id"], []).append(edge["message_id"])
        versions = []
        for row in path:
            siblings = sorted(
                children.get(_parent_key(chat_key, row["parent_id"]), []), key=lambda key: key.time
            )
            if row["message_id"] not in siblings:
                versions.append(UNKNOWN_VERSIONS)
                continue
            at = siblings.index(row["message_id"])
            versions.append(
                Versions(
                    count=len(siblings),
                    number=at + 1,
                    previous_id=str(siblings[at - 1]) if at > 0 else None,
                    next_id=str(siblings[at + 1]) if at + 1 < len(siblings) else None,
                )
            )
        return versions

    async def _newest_under(self, chat_key: uuid.UUID, top: uuid.UUID) -> uuid.UUID:
        """The newest message under ``top`` (``top`` itself if none): one pass over the tree's edges whose
        parent is ``top`` or newer, in parent order. A parent is older than its children, so a message's
        own edge comes before the edges under it: one pass finds every descendant."""
        under = {top}
        newest = top
        position = {"parent_id": top, "message_id": top}  # top's children are newer than top
        while True:
            edges = await self._db.execute(
                "children_after", {"chat_id": chat_key, **position, "rows": _CHILDREN_PAGE}
            )
            for edge in edges:
                if edge["parent_id"] in under:
                    under.add(edge["message_id"])
                    if edge["message_id"].time > newest.time:
                        newest = edge["message_id"]
            if len(edges) < _CHILDREN_PAGE:
                return newest
            position = {"parent_id": edges[-1]["parent_id"], "message_id": edges[-1]["message_id"]}

    async def _walk(
        self, chat_key: uuid.UUID, start: uuid.UUID | None, limit: int, descend: bool = False
    ) -> tuple[list[Row], uuid.UUID | None]:
        """Up to ``limit`` rows of the path from ``start`` (None: the newest message; ``descend``: the
        newest message under ``start``) towards the root, and the id of the path's next message (None:
        the root was reached)."""
        if descend and start is not None:
            start = await self._newest_under(chat_key, start)
        if start is None:
            rows = []
            async for row in self._scan(chat_key, None, limit):
                rows.append(row)
                if len(rows) >= limit:
                    break
            if not rows:
                return [], None
            target: uuid.UUID | None = rows[0]["message_id"]
        else:
            target = start
            rows = await self._upto(chat_key, start, limit)
            if not rows or rows[0]["message_id"] != start:
                return [], None  # not a message of this chat
        path: list[Row] = []
        while target is not None and len(path) < limit:
            for row in rows:
                if row["message_id"] == target:
                    path.append(row)
                    target = row["parent_id"]
                    if target is None or len(path) >= limit:
                        break
                elif row["message_id"].time < target.time:
                    break  # older than the path's next message: the rest of the page is off the path
            if target is None or len(path) >= limit:
                break
            rows = await self._upto(chat_key, target, limit - len(path))
            if not rows or rows[0]["message_id"] != target:
                # A parent is checked when its child is stored: only the leaf can be missing.
                raise RuntimeError(f"message {target} of chat {chat_key} is missing")
        return path, target

    def _upto(self, chat_key: uuid.UUID, message_id: uuid.UUID, rows: int) -> Awaitable[list[Row]]:
        """Up to ``rows`` rows of the chat from ``message_id`` down, in its bucket."""
        where = {"chat_id": chat_key, "bucket": bucket_of(message_id), "message_id": message_id}
        return self._db.execute("messages_upto", {**where, "rows": rows})

    async def _scan(
        self, chat_key: uuid.UUID, start: uuid.UUID | None, page: int, include_start: bool = False
    ) -> AsyncIterator[Row]:
        """Rows of the chat older than ``start`` (or from it, with ``include_start``; all if None),
        newest first, across buckets; ``page`` rows per query.

        The first page of the bucket the scan most likely starts in (``start``'s, or today's for the
        newest rows) is read alongside the chat's bucket list, so a scan of a chat active today takes
        one round trip, not two; a guess the list does not bear out is dropped unread."""
        bucket_cap = bucket_of(start) if start is not None else _MAX_BUCKET
        statement = "messages_upto" if include_start else "messages_below"

        def read_page(bucket: int, cursor: uuid.UUID | None, query: str) -> Awaitable[list[Row]]:
            where = {"chat_id": chat_key, "bucket": bucket, "rows": page}
            if cursor is None:
                return self._db.execute("messages_newest", where)
            return self._db.execute(query, {**where, "message_id": cursor})

        guessed_bucket = bucket_cap if start is not None else bucket_of(new_id())
        first_page = asyncio.ensure_future(read_page(guessed_bucket, start, statement))
        first_page.add_done_callback(_ignore_outcome)
        guessed: asyncio.Future[list[Row]] | None = first_page
        try:
            while True:
                buckets = await self._db.execute(
                    "buckets_upto", {"chat_id": chat_key, "bucket": bucket_cap, "rows": _BUCKET_SCAN_PAGE}
                )
                for entry in buckets:
                    bucket = entry["bucket"]
                    cursor = start if start is not None and bucket == bucket_of(start) else None
                    query = statement
                    while True:
                        if guessed is not None and bucket == guessed_bucket:
                            rows, guessed = await guessed, None
                        else:
                            rows = await read_page(bucket, cursor, query)
                        for row in rows:
                            yield row
                        if len(rows) < page:
                            break
                        cursor, query = rows[-1]["message_id"], "messages_below"
                if len(buckets) < _BUCKET_SCAN_PAGE:
                    return
                bucket_cap = buckets[-1]["bucket"] - 1
        finally:
            if guessed is not None:
                guessed.cancel()


def _ignore_outcome(future: asyncio.Future[Any]) -> None:
    """A speculative read nobody waits for any more: its failure (or cancellation) is of no interest."""
    if not future.cancelled():
        future.exception()


def _parent_key(chat_key: uuid.UUID, parent_id: uuid.UUID | str | None) -> uuid.UUID:
    """A message's parent in ``message_children``: its parent's id, or the chat's for a first message."""
    if parent_id is None or parent_id == "":
        return chat_key
    return parent_id if isinstance(parent_id, uuid.UUID) else uuid.UUID(parent_id)
