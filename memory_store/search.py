"""Search a user's chats by title and message content, with Cassandra's own index (SAI), no second store.

``chat_search`` is ``((user_id), chat_id, item_id)``, newest chat first and newest item first within a
chat: one row per message (``item_id`` = the message id) and one for the chat's title (``item_id`` =
the chat id). Every row holds its text and ``terms``, the set of its words as ``search_terms`` makes
them (Unicode NFKC, case-folded, split on non-word characters). A storage-attached index on
``values(terms)`` (case-insensitive, Unicode-normalized) answers ``terms CONTAINS ?`` for each word of
the query, inside the caller's partition only: another user's chats are not in it.

Why the words are split here: Cassandra 5.0.8's SAI refuses ``index_analyzer`` ("not understood by
StorageAttachedIndex"; the Lucene analyzers came later), and its own options (``case_sensitive``,
``normalize``, ``ascii``) only match whole values. So the tokenizer is ours, and the index's options
are the filters 5.0 has.

Deleting a chat deletes its rows (one range tombstone, in the batch that soft-deletes the chat), and
every hit is checked against the chat's row, so a message written while its chat was being deleted
never shows. Pages are cursors over ``(chat_id, item_id)``, signed for the user and the query.

What it costs: each stored message (and title) writes one more row, about its text plus its distinct
words, and one SAI entry per distinct word (a memtable insert, then part of the SSTable's index); a
search reads one partition, intersecting one posting list per query word (docs/architecture/memory_store.md).

The writes that index (with a chat's or message's own) are ``search_index.py``'s; the queries are here.
"""

from __future__ import annotations

import asyncio
import unicodedata
import uuid
from collections.abc import Sequence

from memory_store.base import check_user, page_size
from memory_store.chats import Chats
from memory_store.config import StoreConfig
from memory_store.cursor import CursorCodec
from memory_store.db import Cql, Db, Row
from memory_store.errors import InvalidArgument
from memory_store.ids import id_time
from memory_store.models import Chat, Message, Page, Role, SearchHit
from memory_store.search_index import WORD, index_write, search_terms, title_write

# Words in one query (each is one more posting list to intersect).
MAX_QUERY_TERMS = 5
SNIPPET_CHARS = 160
# Index pages read to fill one result page when hits belong to deleted chats.
_MAX_ROUNDS = 4
# Writes in flight at once while a backfill indexes one chat.
_BACKFILL_CONCURRENCY = 64

_COLUMNS = "chat_id, item_id, role, text"


def _search_statements() -> dict[str, Cql]:
    statements = {
        # The backfill walks every user with a chat, in token order (a full scan, run once per keyspace).
        "users_first": Cql("SELECT DISTINCT user_id, token(user_id) AS t FROM chats LIMIT :rows", True),
        "users_after": Cql(
            "SELECT DISTINCT user_id, token(user_id) AS t FROM chats WHERE token(user_id) > :after LIMIT :rows",
            True,
        ),
    }
    for count in range(1, MAX_QUERY_TERMS + 1):
        contains = " AND ".join(f"terms CONTAINS :term{i}" for i in range(count))
        statements[f"search_first_{count}"] = Cql(
            f"SELECT {_COLUMNS} FROM chat_search WHERE user_id = :user_id AND {contains} LIMIT :rows", True
        )
        statements[f"search_after_{count}"] = Cql(
            f"SELECT {_COLUMNS} FROM chat_search WHERE user_id = :user_id "
            f"AND (chat_id, item_id) < (:chat_id, :item_id) AND {contains} LIMIT :rows",
            True,
        )
    return statements


STATEMENTS = _search_statements()


def snippet(text: str, terms: Sequence[str]) -> str:
    """About ``SNIPPET_CHARS`` of ``text`` around its first matching word."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    starts = [m.start() for m in WORD.finditer(folded) if m.group() in terms]
    if len(folded) != len(text) or len(text) <= SNIPPET_CHARS:
        start = 0  # a normalization that changed lengths: positions do not carry over
    else:
        start = max(0, min((starts or [0])[0] - SNIPPET_CHARS // 4, len(text) - SNIPPET_CHARS))
    piece = text[start : start + SNIPPET_CHARS]
    return ("…" if start else "") + piece + ("…" if start + SNIPPET_CHARS < len(text) else "")


class Search:
    """Search over the caller's chats (``chat_search``), and the backfill's walk."""

    def __init__(self, db: Db, config: StoreConfig, cursors: CursorCodec, chats: Chats) -> None:
        self._db = db
        self._config = config
        self._cursors = cursors
        self._chats = chats

    async def users_with_chats(self, after: int | None, limit: int) -> tuple[list[str], int | None]:
        """A page of the users who have chats, in token order, and where the next page starts (None:
        the last page). For the search backfill: a full scan of ``chats``' partitions."""
        if after is None:
            rows = await self._db.execute("users_first", {"rows": limit})
        else:
            rows = await self._db.execute("users_after", {"after": after, "rows": limit})
        return [row["user_id"] for row in rows], (rows[-1]["t"] if len(rows) == limit else None)

    async def index_for_search(self, user_id: str, chat: Chat, messages: Sequence[Message]) -> None:
        """Makes a chat written before search existed searchable: its title and ``messages`` (upserts,
        so running it again changes nothing)."""
        chat_key = uuid.UUID(chat.chat_id)
        writes = [title_write(user_id, chat_key, chat.title)] if chat.title else []
        writes += [
            index_write(user_id, chat_key, uuid.UUID(m.message_id), Role(m.role).value, m.content)
            for m in messages
        ]
        for start in range(0, len(writes), _BACKFILL_CONCURRENCY):
            await asyncio.gather(
                *(self._db.execute(*w) for w in writes[start : start + _BACKFILL_CONCURRENCY])
            )

    async def search_chats(
        self, user_id: str, query: str, cursor: str | None = None, limit: int | None = None
    ) -> Page[SearchHit]:
        """The caller's chats whose title or messages contain every word of ``query``: newest chat
        first, newest match first within a chat (its title last), ``limit`` per page (default 20)."""
        check_user(user_id, self._config.bounds)
        terms = search_terms(query)
        if not terms:
            raise InvalidArgument("a search needs at least one word")
        if len(terms) > MAX_QUERY_TERMS:
            raise InvalidArgument(f"a search takes at most {MAX_QUERY_TERMS} words")
        limits = self._config.limits
        limit = page_size(limit, limits.default_search_page, limits.max_search_page)
        scope = "\x00".join([user_id, *terms])
        after = self._search_position(cursor, scope) if cursor else None
        words = {f"term{i}": term for i, term in enumerate(terms)}
        hits: list[SearchHit] = []
        more = False
        for _ in range(_MAX_ROUNDS):
            want = limit + 1 - len(hits)
            values = {"user_id": user_id, **words, "rows": want}
            if after is None:
                rows = await self._db.execute(f"search_first_{len(terms)}", values)
            else:
                position = {"chat_id": after[0], "item_id": after[1]}
                rows = await self._db.execute(f"search_after_{len(terms)}", {**values, **position})
            hits.extend(await self._live_hits(user_id, rows, terms))
            more = len(rows) == want
            if rows:
                after = (rows[-1]["chat_id"], rows[-1]["item_id"])
            if not more or len(hits) > limit:
                break
        page = hits[:limit]
        next_position: list[str | int]
        if len(hits) > limit:
            last = page[-1]
            next_position = [last.chat_id, last.message_id or last.chat_id]
        elif more and after is not None:  # rounds ran out among deleted chats' hits: go on from there
            next_position = [str(after[0]), str(after[1])]
        else:
            return Page(items=page, next_cursor=None)
        return Page(items=page, next_cursor=self._cursors.encode("search", scope, next_position))

    def _search_position(self, cursor: str, scope: str) -> tuple[uuid.UUID, uuid.UUID]:
        position = self._cursors.decode(cursor, "search", scope)
        try:
            return uuid.UUID(str(position[0])), uuid.UUID(str(position[1]))
        except (ValueError, IndexError):
            raise InvalidArgument("page token is invalid; start again from the first page") from None

    async def _live_hits(self, user_id: str, rows: Sequence[Row], terms: list[str]) -> list[SearchHit]:
        """The hits of ``rows`` whose chat is live (not deleted), in index order."""
        if not rows:
            return []
        chats = await self._chats.live(user_id, [row["chat_id"] for row in rows])
        hits = []
        for row in rows:
            chat = chats.get(row["chat_id"])
            if chat is None:
                continue
            is_title = row["item_id"] == row["chat_id"]
            hits.append(
                SearchHit(
                    chat_id=str(row["chat_id"]),
                    chat_title=chat.title,
                    message_id=None if is_title else str(row["item_id"]),
                    role=row["role"],
                    snippet=snippet(row["text"] or "", terms),
                    created_at=chat.created_at if is_title else id_time(row["item_id"]),
                )
            )
        return hits
