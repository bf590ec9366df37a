"""``MemoryStore``: the orchestrator's only door to storage.

    store = await MemoryStore.connect(StoreConfig(port=9042))
    chat = await store.create_chat(user_id, "Trip plans")
    await store.append_message(user_id, Message(new_id_str(), chat.chat_id, Role.USER, "Hi"))
    page = await store.list_messages(user_id, chat.chat_id, before=None, limit=50)
    await store.close()

Every method is async, named for what it does, takes the caller's user id, and speaks dataclasses
(``memory_store.models``) and typed errors (``memory_store.errors``). The store is a façade over one
part per family of tables, each holding the one ``Db`` (the session and its prepared statements):
``chats``, ``messages``, ``search``, ``claims``, ``runs``, ``replicas``, ``usage``. A part that needs
another's writes or checks is handed that part; every method here is a part's. Nothing above this
package sees CQL.
"""

from __future__ import annotations

import secrets

from cassandra.query import SimpleStatement

from chatmesh.limits import Limits
from memory_store import chats, claims, messages, replicas, runs, schema, search, search_index, usage
from memory_store.config import StoreConfig
from memory_store.cursor import CursorCodec
from memory_store.db import Db
from memory_store.models import StoreBounds

_STATEMENTS = {
    **chats.STATEMENTS,
    **messages.STATEMENTS,
    **search_index.STATEMENTS,
    **search.STATEMENTS,
    **claims.STATEMENTS,
    **runs.STATEMENTS,
    **replicas.STATEMENTS,
    **usage.STATEMENTS,
}


class MemoryStore:
    """Chats, messages, runs and usage on Cassandra. Create with ``await MemoryStore.connect(config)``."""

    def __init__(self, db: Db, config: StoreConfig, cursors: CursorCodec) -> None:
        self._db = db
        self._config = config
        self.chats = chats.Chats(db, config, cursors)
        self.messages = messages.Messages(db, config, cursors, self.chats)
        self.search = search.Search(db, config, cursors, self.chats)
        self.claims = claims.Claims(db, config)
        self.usage = usage.UsageWindows(db, config)
        self.runs = runs.Runs(db, config, self.chats, self.messages, self.usage)
        self.replicas = replicas.Replicas(db, self.runs)

        self.create_chat = self.chats.create_chat
        self.get_chat = self.chats.get_chat
        self.list_chats = self.chats.list_chats
        self.rename_chat = self.chats.rename_chat
        self.set_chat_model = self.chats.set_chat_model
        self.set_chat_metadata = self.chats.set_chat_metadata
        self.delete_chat = self.chats.delete_chat
        self.put_summary = self.chats.put_summary

        self.append_message = self.messages.append_message
        self.get_message = self.messages.get_message
        self.delete_message = self.messages.delete_message
        self.list_messages = self.messages.list_messages
        self.get_branch = self.messages.get_branch
        self.branch_page = self.messages.branch_page

        self.search_chats = self.search.search_chats
        self.users_with_chats = self.search.users_with_chats
        self.index_for_search = self.search.index_for_search

        self.claim_idempotency_key = self.claims.claim_idempotency_key
        self.unkeyed_claim = self.claims.unkeyed_claim
        self.take_start_lease = self.claims.take_start_lease
        self.renew_claim = self.claims.renew_claim
        self.release_start_lease = self.claims.release_start_lease

        self.create_run = self.runs.create_run
        self.create_run_with_question = self.runs.create_run_with_question
        self.adopt_run = self.runs.adopt_run
        self.checkpoint_runs = self.runs.checkpoint_runs
        self.store_step = self.runs.store_step
        self.finish_run = self.runs.finish_run
        self.settle_run = self.runs.settle_run
        self.get_run = self.runs.get_run
        self.read_run_output = self.runs.read_run_output
        self.find_owned_runs = self.runs.find_owned_runs

        self.heartbeat_replica = self.replicas.heartbeat_replica
        self.forget_replica = self.replicas.forget_replica
        self.find_orphaned_runs = self.replicas.find_orphaned_runs
        self.signal_owner = self.replicas.signal_owner
        self.signalled_runs = self.replicas.signalled_runs

        self.window_start = self.usage.window_start
        self.record_usage = self.usage.record_usage
        self.get_usage = self.usage.get_usage

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

    @property
    def limits(self) -> Limits:
        return self._config.limits

    @property
    def bounds(self) -> StoreBounds:
        return self._config.bounds

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
