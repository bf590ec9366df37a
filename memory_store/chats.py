"""Chats: create, read, list by recent activity, rename, soft delete, activity, active run, summary.

A chat row lives in its owner's partition (``chats``: ``((user_id), chat_id)``), so every read is
scoped by the caller's user id and another user's chat is NOT_FOUND by construction.

``chats_by_activity`` orders a user's chats by their latest activity. Moving a chat to the top deletes
its old index entry and inserts the new one, together with ``chats.activity_at``, in one batch on one
partition key (atomic, no batchlog). Every write carries the activity time as its write timestamp, so
the newest activity wins whatever order concurrent writers land in. Readers trust ``chats`` over the
index: an index entry that no longer matches its chat's ``activity_at`` (a lost race, a deleted chat)
is skipped and removed.

The active run uses the same idea without nulls: ``last_run_id`` and ``last_finished_run_id`` are
written with the run id's time as write timestamp; the chat has an active run while they differ.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TypeVar

from memory_store.base import (
    check_fingerprint,
    check_idempotency_key,
    check_user,
    id_str,
    micros,
    now,
    page_size,
    unset,
    utc,
)
from memory_store.config import StoreConfig
from memory_store.cursor import CursorCodec
from memory_store.db import Cql, Db, Row, Write
from memory_store.errors import AlreadyExists, InvalidArgument, NotFound
from memory_store.ids import id_micros, new_id, parse_id
from memory_store.models import Chat, ChatSummary, Page, StoreBounds
from memory_store.search_index import delete_write, title_write

T = TypeVar("T")

_CHAT_COLUMNS = (
    "chat_id, title, created_at, activity_at, deleted_at, last_run_id, last_finished_run_id, model, metadata"
)
_CHAT_KEY = "user_id = :user_id AND chat_id = :chat_id"

STATEMENTS = {
    "chat_insert": Cql(
        "INSERT INTO chats (user_id, chat_id, title, created_at, activity_at, model, metadata) "
        "VALUES (:user_id, :chat_id, :title, :created_at, :activity_at, :model, :metadata) "
        "USING TIMESTAMP :write_ts",
        idempotent=True,
    ),
    "chat_get": Cql(f"SELECT {_CHAT_COLUMNS} FROM chats WHERE {_CHAT_KEY}", True),
    "chat_get_many": Cql(
        f"SELECT {_CHAT_COLUMNS} FROM chats WHERE user_id = :user_id AND chat_id IN :chat_ids", True
    ),
    "chat_set_activity": Cql(
        f"UPDATE chats USING TIMESTAMP :write_ts SET activity_at = :activity_at WHERE {_CHAT_KEY}", True
    ),
    "chat_set_model": Cql(f"UPDATE chats SET model = :model WHERE {_CHAT_KEY}", True),
    "chat_set_metadata": Cql(f"UPDATE chats SET metadata = :metadata WHERE {_CHAT_KEY}", True),
    "chat_set_title": Cql(f"UPDATE chats SET title = :title WHERE {_CHAT_KEY}", True),
    "chat_set_deleted": Cql(f"UPDATE chats SET deleted_at = :deleted_at WHERE {_CHAT_KEY}", True),
    "chat_set_last_run": Cql(
        f"UPDATE chats USING TIMESTAMP :write_ts SET last_run_id = :run_id WHERE {_CHAT_KEY}", True
    ),
    "chat_set_last_finished_run": Cql(
        f"UPDATE chats USING TIMESTAMP :write_ts SET last_finished_run_id = :run_id WHERE {_CHAT_KEY}",
        True,
    ),
    "activity_insert": Cql(
        "INSERT INTO chats_by_activity (user_id, activity_at, chat_id) "
        "VALUES (:user_id, :activity_at, :chat_id) USING TIMESTAMP :write_ts",
        True,
    ),
    "activity_delete": Cql(
        "DELETE FROM chats_by_activity USING TIMESTAMP :write_ts "
        "WHERE user_id = :user_id AND activity_at = :activity_at AND chat_id = :chat_id",
        True,
    ),
    "activity_first": Cql(
        "SELECT activity_at, chat_id FROM chats_by_activity WHERE user_id = :user_id LIMIT :rows", True
    ),
    "activity_after": Cql(
        "SELECT activity_at, chat_id FROM chats_by_activity "
        "WHERE user_id = :user_id AND (activity_at, chat_id) < (:activity_at, :chat_id) LIMIT :rows",
        True,
    ),
    "chat_key_claim": Cql(
        "INSERT INTO chat_keys (user_id, key, chat_id, title) VALUES (:user_id, :key, :chat_id, :title) "
        "IF NOT EXISTS USING TTL :ttl_s",
        # Running it again leaves the same row: the first call's. The caller recognises its own chat id.
        idempotent=True,
    ),
    "summary_put": Cql(
        "INSERT INTO chat_summaries (chat_id, text, token_count, through_message_id, updated_at, "
        "tokenizer_fingerprint) VALUES (:chat_id, :text, :token_count, :through_message_id, :updated_at, "
        ":tokenizer_fingerprint)",
        True,
    ),
    "summary_delete": Cql("DELETE FROM chat_summaries WHERE chat_id = :chat_id", True),
    "summary_get": Cql(
        "SELECT text, token_count, through_message_id, updated_at, tokenizer_fingerprint FROM chat_summaries "
        "WHERE chat_id = :chat_id",
        True,
    ),
}


def _summary(rows: list[Row]) -> ChatSummary | None:
    """The summary ``summary_get`` read, if any."""
    if not rows:
        return None
    row = rows[0]
    return ChatSummary(
        row["text"],
        row["token_count"],
        str(row["through_message_id"]),
        utc(row["updated_at"]),
        row["tokenizer_fingerprint"] or "",
    )


def _created_at(chat_id: uuid.UUID) -> datetime:
    """The creation time a chat's id was made from (``now()``: whole milliseconds)."""
    return datetime.fromtimestamp(round(id_micros(chat_id) / 1000) / 1000, UTC)


def check_metadata(metadata: Mapping[str, str], bounds: StoreBounds) -> None:
    """INVALID_ARGUMENT unless ``metadata`` is within OpenAI's bounds (16 pairs, keys of 64 characters,
    values of 512)."""
    if len(metadata) > bounds.max_metadata_pairs:
        raise InvalidArgument(f"metadata holds at most {bounds.max_metadata_pairs} pairs")
    for key, value in metadata.items():
        if not key or len(key) > bounds.max_metadata_key_chars:
            raise InvalidArgument(f"metadata keys have 1..{bounds.max_metadata_key_chars} characters")
        if len(value) > bounds.max_metadata_value_chars:
            raise InvalidArgument(
                f"metadata values have at most {bounds.max_metadata_value_chars} characters"
            )


def _chat(user_id: str, row: Row) -> Chat | None:
    """A live chat from its row; None for a deleted chat or a row without a creation (never created)."""
    if row["deleted_at"] is not None or row["created_at"] is None:
        return None
    last, finished = row["last_run_id"], row["last_finished_run_id"]
    return Chat(
        chat_id=str(row["chat_id"]),
        user_id=user_id,
        title=row["title"] or "",
        created_at=utc(row["created_at"]),
        updated_at=utc(row["activity_at"]),
        active_run_id=id_str(last) if last is not None and last != finished else None,
        model=row["model"] or "",
        metadata=dict(row["metadata"] or {}),
    )


class Chats:
    """A user's chats (``chats``), their order by activity (``chats_by_activity``), the keys of
    idempotent creations (``chat_keys``) and their summaries (``chat_summaries``)."""

    def __init__(self, db: Db, config: StoreConfig, cursors: CursorCodec) -> None:
        self._db = db
        self._config = config
        self._cursors = cursors

    async def create_chat(
        self,
        user_id: str,
        title: str = "",
        idempotency_key: str = "",
        model: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> Chat:
        """A new empty chat owned by ``user_id`` (title may be empty: set it later with rename_chat),
        answered by ``model`` (the caller checks it is served), with ``metadata`` (``check_metadata``).

        With ``idempotency_key``, every call with the same key gets the chat the first one created, as
        it is now (renamed, with messages); ALREADY_EXISTS if that first call had another title, and
        NOT_FOUND once that chat is deleted. The key is claimed before the chat is written, so a call
        that died between the two leaves its retry to write the chat, with the same id and times.
        """
        check_user(user_id, self._config.bounds)
        self._check_title(title, allow_empty=True)
        metadata = dict(metadata or {})
        check_metadata(metadata, self._config.bounds)
        at = now()
        chat_id = new_id(at)
        if idempotency_key:
            earlier = await self._claim_chat_key(user_id, idempotency_key, chat_id, title)
            if earlier is not None:
                rows = await self._db.execute("chat_get", {"user_id": user_id, "chat_id": earlier})
                if rows and rows[0]["created_at"] is not None:
                    if (chat := _chat(user_id, rows[0])) is None:
                        raise NotFound("the chat this idempotency key created was deleted; use a new key")
                    return chat
                # Claimed and never written: write it as its first call would have.
                chat_id, at = earlier, _created_at(earlier)
        ts = micros(at)
        key = {"user_id": user_id, "chat_id": chat_id}
        statements: list[Write] = [
            (
                "chat_insert",
                {
                    **key,
                    "title": title,
                    "created_at": at,
                    "activity_at": at,
                    "model": model,
                    "metadata": metadata,
                    "write_ts": ts,
                },
            ),
            ("activity_insert", {**key, "activity_at": at, "write_ts": ts}),
        ]
        if title:
            statements.append(title_write(user_id, chat_id, title))
        await self._db.execute_batch(statements)
        return Chat(
            chat_id=str(chat_id),
            user_id=user_id,
            title=title,
            created_at=at,
            updated_at=at,
            model=model,
            metadata=metadata,
        )

    async def _claim_chat_key(
        self, user_id: str, key: str, chat_id: uuid.UUID, title: str
    ) -> uuid.UUID | None:
        """Claims ``key`` for the chat about to be created: None if this call holds it, else the chat
        id an earlier call claimed it for (ALREADY_EXISTS if that call had another title)."""
        check_idempotency_key(key, self._config.limits)
        claim = {"user_id": user_id, "key": key, "chat_id": chat_id, "title": title}
        row = await self._db.execute_contended(
            "chat_key_claim", {**claim, "ttl_s": self._config.idempotency_ttl_s}
        )
        if row["[applied]"] or row["chat_id"] == chat_id:
            return None
        if (row["title"] or "") != title:
            raise AlreadyExists(
                "this idempotency key already created a chat with another title; use a new key"
            )
        return row["chat_id"]

    async def get_chat(self, user_id: str, chat_id: str) -> Chat:
        """The chat; NOT_FOUND if it does not exist, is deleted, or belongs to someone else."""
        return await self.owned(user_id, chat_id)

    async def list_chats(
        self, user_id: str, cursor: str | None = None, limit: int | None = None
    ) -> Page[Chat]:
        """The user's chats, most recent activity first, ``limit`` per page (default 20)."""
        check_user(user_id, self._config.bounds)
        limits = self._config.limits
        limit = page_size(limit, limits.default_chat_page, limits.max_chat_page)
        after: tuple[datetime, uuid.UUID] | None = None
        if cursor:
            position = self._cursors.decode(cursor, "chats", user_id)
            try:
                after = (datetime.fromtimestamp(int(position[0]) / 1000, UTC), uuid.UUID(str(position[1])))
            except (ValueError, IndexError, OverflowError):
                raise InvalidArgument("page token is invalid; start again from the first page") from None
        found: list[Chat] = []
        exhausted = False
        while len(found) <= limit and not exhausted:
            want = limit + 1 - len(found)
            if after is None:
                rows = await self._db.execute("activity_first", {"user_id": user_id, "rows": want})
            else:
                position_values = {"activity_at": after[0], "chat_id": after[1]}
                rows = await self._db.execute(
                    "activity_after", {"user_id": user_id, **position_values, "rows": want}
                )
            exhausted = len(rows) < want
            if not rows:
                break
            after = (rows[-1]["activity_at"], rows[-1]["chat_id"])
            found.extend(await self._chats_for_index(user_id, rows))
        page = found[:limit]
        next_cursor = None
        if len(found) > limit:
            last = page[-1]
            position = [micros(last.updated_at) // 1000, last.chat_id]
            next_cursor = self._cursors.encode("chats", user_id, position)
        return Page(items=page, next_cursor=next_cursor)

    async def live(self, user_id: str, chat_keys: Sequence[uuid.UUID]) -> dict[uuid.UUID, Chat]:
        """The live chats among ``chat_keys`` of ``user_id``, by id (one read)."""
        ids = list(dict.fromkeys(chat_keys))
        rows = await self._db.execute("chat_get_many", {"user_id": user_id, "chat_ids": ids})
        return {row["chat_id"]: chat for row in rows if (chat := _chat(user_id, row)) is not None}

    async def _chats_for_index(self, user_id: str, index_rows: Sequence[Row]) -> list[Chat]:
        """The live chats an index page points to, in index order; stale entries are removed."""
        by_id = await self.live(user_id, [row["chat_id"] for row in index_rows])
        chats, stale = [], []
        for entry in index_rows:
            chat = by_id.get(entry["chat_id"])
            if chat is None or chat.updated_at != utc(entry["activity_at"]):
                stale.append(entry)
                continue
            chats.append(chat)
        if stale:
            await asyncio.gather(
                *(
                    self._db.execute(
                        "activity_delete",
                        {
                            "write_ts": micros(max(now(), utc(e["activity_at"]))) + 1,
                            "user_id": user_id,
                            "activity_at": e["activity_at"],
                            "chat_id": e["chat_id"],
                        },
                    )
                    for e in stale
                )
            )
        return chats

    async def rename_chat(self, user_id: str, chat_id: str, title: str) -> Chat:
        """Sets the title (1..``limits.max_title_chars`` characters); a rename counts as activity."""
        self._check_title(title, allow_empty=False)
        chat = await self.owned(user_id, chat_id)
        key = uuid.UUID(chat.chat_id)
        renamed: Write = ("chat_set_title", {"title": title, "user_id": user_id, "chat_id": key})
        writes, at = self.touch_writes(chat, [renamed, title_write(user_id, key, title)])
        await self._db.execute_batch(writes)
        return dataclasses.replace(chat, title=title, updated_at=at)

    async def set_chat_model(self, user_id: str, chat_id: str, model: str) -> None:
        """The model the chat's next answers come from (a send switching it); not activity."""
        key = {"user_id": user_id, "chat_id": parse_id(chat_id, "chat id")}
        await self._db.execute("chat_set_model", {"model": model, **key})

    async def set_chat_metadata(self, user_id: str, chat_id: str, metadata: Mapping[str, str]) -> Chat:
        """Replaces the chat's metadata whole (``check_metadata``); not activity."""
        check_metadata(metadata, self._config.bounds)
        chat = await self.owned(user_id, chat_id)
        key = {"user_id": user_id, "chat_id": uuid.UUID(chat.chat_id)}
        await self._db.execute("chat_set_metadata", {"metadata": dict(metadata), **key})
        return dataclasses.replace(chat, metadata=dict(metadata))

    async def delete_chat(self, user_id: str, chat_id: str) -> None:
        """Soft delete: the chat vanishes from lists and reads at once; its rows stay for retention."""
        chat = await self.owned(user_id, chat_id)
        at = now()
        chat_key = uuid.UUID(chat.chat_id)
        key = {"user_id": user_id, "chat_id": chat_key}
        # The index entry was written with its activity time as timestamp: delete it from above that.
        delete_ts = max(micros(at), micros(chat.updated_at) + 1)
        await self._db.execute_batch(
            [
                ("chat_set_deleted", {"deleted_at": at, **key}),
                ("activity_delete", {"write_ts": delete_ts, "activity_at": chat.updated_at, **key}),
                delete_write(user_id, chat_key),
            ]
        )

    def touch_writes(self, chat: Chat, extra: Sequence[Write]) -> tuple[list[Write], datetime]:
        """The writes that set the chat's activity to now, with ``extra`` (more writes to the owner's
        partition): one batch in the owner's partition; and the chat's activity time."""
        at = now()
        writes = list(extra)
        # A clock behind the last activity (another replica's) leaves the order as it is.
        if at > chat.updated_at:
            ts = micros(at)
            key = {"user_id": chat.user_id, "chat_id": uuid.UUID(chat.chat_id)}
            writes += [
                ("activity_delete", {"write_ts": ts, "activity_at": chat.updated_at, **key}),
                ("activity_insert", {**key, "activity_at": at, "write_ts": ts}),
                ("chat_set_activity", {"write_ts": ts, "activity_at": at, **key}),
            ]
        return writes, max(at, chat.updated_at)

    def active_run_write(self, user_id: str, chat_id: str, run_id: str) -> Write:
        """The write that marks ``run_id`` the chat's active run (the newest run by id wins): to the
        owner's partition."""
        return self._last_run("chat_set_last_run", user_id, chat_id, run_id)

    def active_run_cleared(self, user_id: str, chat_id: str, run_id: str) -> Write:
        """The write that marks ``run_id`` finished (the chat has no active run unless a newer run
        started since): to the owner's partition."""
        return self._last_run("chat_set_last_finished_run", user_id, chat_id, run_id)

    def _last_run(self, statement: str, user_id: str, chat_id: str, run_id: str) -> Write:
        """A write of the chat's last started or finished run, with the run id's time as timestamp."""
        run = parse_id(run_id, "run id")
        return statement, {
            "write_ts": id_micros(run),
            "run_id": run,
            "user_id": check_user(user_id, self._config.bounds),
            "chat_id": parse_id(chat_id, "chat id"),
        }

    async def put_summary(self, user_id: str, chat_id: str, summary: ChatSummary) -> ChatSummary:
        """Stores the chat's rolling summary of older turns (replacing the previous one)."""
        chat = await self.owned(user_id, chat_id)
        max_bytes = self._config.bounds.max_summary_bytes
        if len(summary.text.encode()) > max_bytes:
            raise InvalidArgument(f"summary is larger than {max_bytes} bytes")
        if summary.token_count < 0:
            raise InvalidArgument("summary token count must not be negative")
        fingerprint = check_fingerprint(summary.tokenizer_fingerprint, self._config.bounds)
        through = parse_id(summary.through_message_id, "through message id")
        at = now()
        await self._db.execute(
            "summary_put",
            {
                "chat_id": uuid.UUID(chat.chat_id),
                "text": summary.text,
                "token_count": summary.token_count,
                "through_message_id": through,
                "updated_at": at,
                "tokenizer_fingerprint": unset(fingerprint or None),
            },
        )
        return ChatSummary(summary.text, summary.token_count, str(through), at, fingerprint)

    def summary_dropped(self, chat_key: uuid.UUID) -> Write:
        """The write that drops the chat's rolling summary (a message it may hold was deleted)."""
        return "summary_delete", {"chat_id": chat_key}

    async def summary(self, chat_key: uuid.UUID) -> ChatSummary | None:
        """The chat's summary, if any (the caller checks the chat is the user's)."""
        return _summary(await self._db.execute("summary_get", {"chat_id": chat_key}))

    async def with_owner(self, user_id: str, chat_id: str, read: Awaitable[T]) -> tuple[Chat, T]:
        """Runs ``read`` alongside the ownership check, saving a round trip; whatever ``read`` found
        or failed with is only passed on once the chat is known to be the caller's."""
        chat, result = await asyncio.gather(self.owned(user_id, chat_id), read, return_exceptions=True)
        if isinstance(chat, BaseException):
            raise chat
        if isinstance(result, BaseException):
            raise result
        return chat, result

    async def owned(self, user_id: str, chat_id: str) -> Chat:
        """The chat, if it is live and the caller's; NOT_FOUND otherwise."""
        check_user(user_id, self._config.bounds)
        rows = await self._db.execute(
            "chat_get", {"user_id": user_id, "chat_id": parse_id(chat_id, "chat id")}
        )
        chat = _chat(user_id, rows[0]) if rows else None
        if chat is None:
            raise NotFound(f"chat {chat_id} not found")
        return chat

    def _check_title(self, title: str, allow_empty: bool) -> None:
        low, high = 0 if allow_empty else 1, self._config.limits.max_title_chars
        if not low <= len(title) <= high:
            raise InvalidArgument(f"title must be {low}..{high} characters")
