"""``MemoryStore``: the orchestrator's only door to storage.

    store = await MemoryStore.connect(StoreConfig(port=9042))
    chat = await store.create_chat(user_id, "Trip plans")
    await store.append_message(user_id, Message(new_id_str(), chat.chat_id, Role.USER, "Hi"))
    page = await store.list_messages(user_id, chat.chat_id, before=None, limit=50)
    await store.close()

Every method is async, named for what it does, takes the caller's user id, and speaks dataclasses
(``memory_store.models``) and typed errors (``memory_store.errors``). The parts live in their own
modules: ``chats``, ``messages``, ``runs``, ``usage``. Nothing above this package sees CQL.
"""

from __future__ import annotations

import secrets

from cassandra.query import SimpleStatement

from memory_store import chats, messages, runs, schema, usage
from memory_store.config import StoreConfig
from memory_store.cursor import CursorCodec
from memory_store.db import Db
from memory_store.runs import RunsMixin

_STATEMENTS = {**chats.STATEMENTS, **messages.STATEMENTS, **runs.STATEMENTS, **usage.STATEMENTS}


class MemoryStore(RunsMixin):
    """Chats, messages, runs and usage on Cassandra. Create with ``await MemoryStore.connect(config)``."""

    @classmethod
    async def connect(cls, config: StoreConfig | None = None) -> MemoryStore:
        """Connects, applies schema migrations (if configured), and prepares every statement."""
        config = config or StoreConfig()
        db = await Db.connect(
            config.contact_points, config.port, config.local_dc, config.request_timeout_s, config.security
        )
        try:
            if config.apply_schema:
                await schema.apply(db, config.keyspace, config.replication)
            else:
                await db.use_keyspace(config.keyspace)
            await db.prepare(_STATEMENTS)
            key = await _cursor_key(db)
        except BaseException:
            await db.close()
            raise
        return cls(db, config, CursorCodec(key))

    async def close(self) -> None:
        await self._db.close()


async def _cursor_key(db: Db) -> bytes:
    """The keyspace's cursor-signing key, created by whichever replica asks first."""
    created = secrets.token_bytes(32)
    rows = await db.execute(
        SimpleStatement(
            "INSERT INTO store_secrets (name, value) VALUES ('cursor_key', %s) IF NOT EXISTS",
            is_idempotent=True,
        ),
        (created,),
        operation="cursor_key",
    )
    return created if rows[0]["[applied]"] else rows[0]["value"]
