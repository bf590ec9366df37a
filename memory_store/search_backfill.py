"""The migration path of search for keyspaces that had chats before it: index every live chat's title and
messages (``python -m memory_store search-backfill``).

Migration 2 creates ``chat_search`` and its index; from then on every write indexes itself. Chats and
messages written before that are indexed by this walk over every user (in token order), their live
chats (deleted ones are never indexed) and every message of each (all branches). Every write is an
upsert, so the walk can be stopped and run again, and run while replicas serve.
"""

from __future__ import annotations

from memory_store.store import MemoryStore

USERS_PER_PAGE = 200


async def backfill_search(store: MemoryStore) -> tuple[int, int]:
    """Indexes every live chat of every user; returns (chats, messages) indexed."""
    chats = messages = 0
    after: int | None = None
    while True:
        users, after = await store.users_with_chats(after, USERS_PER_PAGE)
        for user in users:
            chat_cursor = None
            while True:
                page = await store.list_chats(user, chat_cursor, store.limits.max_chat_page)
                for chat in page.items:
                    found, message_cursor = [], None
                    while True:
                        listed = await store.list_messages(
                            user, chat.chat_id, message_cursor, store.limits.max_message_page
                        )
                        found.extend(listed.items)
                        if (message_cursor := listed.next_cursor) is None:
                            break
                    await store.index_for_search(user, chat, found)
                    chats, messages = chats + 1, messages + len(found)
                if (chat_cursor := page.next_cursor) is None:
                    break
        if after is None:
            return chats, messages
