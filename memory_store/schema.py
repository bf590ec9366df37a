"""The keyspace and its tables, as versioned migrations applied idempotently at start.

Each migration is a list of statements that are safe to run again (``IF NOT EXISTS``); applied
versions are recorded in ``schema_migrations``, so a start applies only what is new, and a start that
died half way through a migration simply runs it again. Each step waits until every node agrees on the
schema before the next one reads or writes the new tables. In a multi-replica deployment run migrations
from one place (``python -m memory_store schema`` as a deploy job): concurrent DDL from several
clients can race in Cassandra 5.0.

Why the tables look the way they do (see docs/architecture/memory_store.md for the full story):

- ``messages``: ``((chat_id, bucket), message_id)`` newest first, like Discord. ``bucket`` is the day of
  the message id (``BUCKET_SECONDS``), so a partition holds one chat's messages of one day: bounded by
  the per-user rate limit and token budget, and a "last 50 turns" read usually touches one partition.
  ``message_buckets`` lists a chat's non-empty buckets, so paging never probes empty days.
- ``message_children``: ``((chat_id), parent_id, message_id)``, a chat's tree as its edges (a first
  message is under the chat's own id): a parent's children, its replies' versions, are rows side by side,
  so a branch page reads its messages' versions in one query of one partition.
- ``chats`` lives in the user's partition, so ownership is the key itself: another user's chat is simply
  not there. ``chats_by_activity`` orders them by recent activity; moving a chat is a delete + insert
  in one single-partition batch. The delete leaves a tombstone, so the table keeps them only an hour
  (``gc_grace_seconds``); readers check each entry against ``chats.activity_at``, so a stale or
  resurrected entry is skipped, never shown.
- ``runs``: run state in static columns, output checkpoints as clustering rows of the same partition,
  so a finish can atomically append the last output and move the status in one conditional batch.
- Lists are ``frozen`` (an unfrozen collection write first deletes the old one: a tombstone).
- No statement ever binds a null: absent values are left unset.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from cassandra.query import SimpleStatement

from memory_store.db import Db

BUCKET_SECONDS = 86_400
RUN_INDEX_BUCKET_SECONDS = 60
# run_signals: a partition holds what one replica was told in ten seconds, and a row lives ten minutes
# (its reader reads the last few partitions, so it never reads an expired row).
RUN_SIGNAL_BUCKET_SECONDS = 10
RUN_SIGNAL_TTL_S = 600

DDL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "chats, messages, runs, idempotency keys, usage, summaries",
        (
            """CREATE TABLE IF NOT EXISTS store_secrets (
                name text PRIMARY KEY,
                value blob)""",
            """CREATE TABLE IF NOT EXISTS chats (
                user_id text,
                chat_id timeuuid,
                title text,
                created_at timestamp,
                activity_at timestamp,
                deleted_at timestamp,
                last_run_id timeuuid,
                last_finished_run_id timeuuid,
                PRIMARY KEY ((user_id), chat_id))
              WITH CLUSTERING ORDER BY (chat_id DESC)""",
            """CREATE TABLE IF NOT EXISTS chats_by_activity (
                user_id text,
                activity_at timestamp,
                chat_id timeuuid,
                PRIMARY KEY ((user_id), activity_at, chat_id))
              WITH CLUSTERING ORDER BY (activity_at DESC, chat_id DESC)
              AND gc_grace_seconds = 3600
              AND compaction = {'class': 'LeveledCompactionStrategy'}""",
            """CREATE TABLE IF NOT EXISTS messages (
                chat_id timeuuid,
                bucket int,
                message_id timeuuid,
                parent_id timeuuid,
                role text,
                content text,
                token_count int,
                model text,
                finish_reason text,
                status text,
                run_id timeuuid,
                created_at timestamp,
                prompt_tokens int,
                cached_prompt_tokens int,
                completion_tokens int,
                PRIMARY KEY ((chat_id, bucket), message_id))
              WITH CLUSTERING ORDER BY (message_id DESC)""",
            """CREATE TABLE IF NOT EXISTS message_buckets (
                chat_id timeuuid,
                bucket int,
                PRIMARY KEY ((chat_id), bucket))
              WITH CLUSTERING ORDER BY (bucket DESC)""",
            """CREATE TABLE IF NOT EXISTS chat_summaries (
                chat_id timeuuid PRIMARY KEY,
                text text,
                token_count int,
                through_message_id timeuuid,
                updated_at timestamp)""",
            """CREATE TABLE IF NOT EXISTS idempotency_keys (
                user_id text,
                key text,
                fingerprint blob,
                run_id timeuuid,
                user_message_id timeuuid,
                assistant_message_id timeuuid,
                PRIMARY KEY ((user_id, key)))""",
            """CREATE TABLE IF NOT EXISTS runs (
                run_id timeuuid,
                first_seq bigint,
                texts frozen<list<text>>,
                token_counts frozen<list<int>>,
                user_id text static,
                chat_id timeuuid static,
                user_message_id timeuuid static,
                parent_message_id timeuuid static,
                assistant_message_id timeuuid static,
                model text static,
                owner_id text static,
                status text static,
                finish_reason text static,
                last_seq bigint static,
                checkpointed_at timestamp static,
                finished_at timestamp static,
                prompt_tokens int static,
                cached_prompt_tokens int static,
                completion_tokens int static,
                error_code text static,
                error_message text static,
                PRIMARY KEY ((run_id), first_seq))""",
            # In-progress runs by owning replica and start minute; a row is deleted when its run ends.
            """CREATE TABLE IF NOT EXISTS runs_by_owner (
                owner_id text,
                bucket bigint,
                run_id timeuuid,
                PRIMARY KEY ((owner_id, bucket), run_id))
              WITH gc_grace_seconds = 3600
              AND default_time_to_live = 86400""",
            """CREATE TABLE IF NOT EXISTS replicas (
                service text,
                replica_id text,
                heartbeat_at timestamp,
                PRIMARY KEY ((service), replica_id))
              WITH gc_grace_seconds = 3600""",
            # One row per run and budget window: recording the same run twice is an upsert, not a
            # double count (counters would double count a retried increment). ``run_id`` holds the
            # run's charge id (usage.py; its run id for runs stored before migration 7).
            """CREATE TABLE IF NOT EXISTS usage_by_run (
                user_id text,
                window_start timestamp,
                run_id timeuuid,
                prompt_tokens bigint,
                cached_prompt_tokens bigint,
                completion_tokens bigint,
                PRIMARY KEY ((user_id, window_start), run_id))
              WITH default_time_to_live = 3024000""",
        ),
    ),
    Migration(
        2,
        "idempotency keys: the start lease of the attempt starting their run",
        (
            # Until when the attempt that holds it may start the key's run: a retry on another replica
            # waits for that run instead of starting a second one (runs.py, take_start_lease).
            "ALTER TABLE idempotency_keys ADD IF NOT EXISTS starting_until timestamp",
        ),
    ),
    Migration(
        3,
        "chat search: chat_search and its SAI index on the words of titles and messages",
        (
            # memory_store/search.py: one row per message and per title, in the owner's partition.
            """CREATE TABLE IF NOT EXISTS chat_search (
                user_id text,
                chat_id timeuuid,
                item_id timeuuid,
                role text,
                text text,
                terms set<text>,
                PRIMARY KEY ((user_id), chat_id, item_id))
              WITH CLUSTERING ORDER BY (chat_id DESC, item_id DESC)""",
            """CREATE CUSTOM INDEX IF NOT EXISTS chat_search_terms ON chat_search (values(terms))
              USING 'StorageAttachedIndex'
              WITH OPTIONS = {'case_sensitive': 'false', 'normalize': 'true'}""",
        ),
    ),
    Migration(
        4,
        "runs: how each is generated, and the token ids of its checkpointed output (adoption)",
        (
            # runs.py, adopt_run: another replica continues a run from these, exactly.
            "ALTER TABLE runs ADD IF NOT EXISTS generation blob static",
            "ALTER TABLE runs ADD IF NOT EXISTS token_ids frozen<list<int>>",
        ),
    ),
    Migration(
        5,
        "chat keys: the chat an idempotency key created",
        (
            # chats.py, create_chat: a retried create with the same key gets the same chat.
            """CREATE TABLE IF NOT EXISTS chat_keys (
                user_id text,
                key text,
                chat_id timeuuid,
                title text,
                PRIMARY KEY ((user_id, key)))""",
        ),
    ),
    Migration(
        6,
        "run signals: the runs another replica ended or adopted, for their owner to read again",
        (
            # runs.py, signal_owner: an owner reads one partition a few seconds instead of each run.
            f"""CREATE TABLE IF NOT EXISTS run_signals (
                owner_id text,
                bucket bigint,
                run_id timeuuid,
                PRIMARY KEY ((owner_id, bucket), run_id))
              WITH default_time_to_live = {RUN_SIGNAL_TTL_S}
              AND gc_grace_seconds = {RUN_SIGNAL_TTL_S}""",
        ),
    ),
    Migration(
        7,
        "runs: the id their usage is charged under (made when their budget is reserved)",
        (
            # usage.py: a run is charged in the window it starts in, whoever records its end.
            "ALTER TABLE runs ADD IF NOT EXISTS charge_id timeuuid static",
        ),
    ),
    Migration(
        8,
        "runs: tool steps among their output events",
        (
            # orchestrator/runs/tool_steps.py: per event of a checkpoint row, its step record or "".
            "ALTER TABLE runs ADD IF NOT EXISTS steps frozen<list<text>>",
        ),
    ),
    Migration(
        9,
        "chats: the model a chat is answered with (empty: the orchestrator's default model)",
        ("ALTER TABLE chats ADD IF NOT EXISTS model text",),
    ),
    Migration(
        10,
        "token counts keyed by tokenizer: the fingerprint of the tokenizer each stored count is of",
        (
            # A count of one tokenizer is never read as another's (orchestrator/upkeep/summaries.py):
            # a chat may switch to a model of another tokenizer. Null: unknown (counted anew).
            "ALTER TABLE messages ADD IF NOT EXISTS tokenizer_fingerprint text",
            "ALTER TABLE chat_summaries ADD IF NOT EXISTS tokenizer_fingerprint text",
            "ALTER TABLE runs ADD IF NOT EXISTS tokenizer_fingerprint text static",
        ),
    ),
    Migration(
        11,
        "messages: an answer's tool calls, and a tool result's call",
        (
            # messages.py: tool_calls is a JSON list of {id, name, arguments} (null: no call); a tool
            # message (role "tool") names the call it answers and that call's function.
            "ALTER TABLE messages ADD IF NOT EXISTS tool_calls text",
            "ALTER TABLE messages ADD IF NOT EXISTS tool_call_id text",
            "ALTER TABLE messages ADD IF NOT EXISTS tool_name text",
        ),
    ),
    Migration(
        12,
        "runs: the log-probabilities of their checkpointed output's tokens (runs that ask for them)",
        (
            # runs.py: per event of a checkpoint row, its tokens' logprobs (empty where none), or null.
            "ALTER TABLE runs ADD IF NOT EXISTS logprobs frozen<list<blob>>",
        ),
    ),
    Migration(
        13,
        "chats: the caller's metadata (the OpenAI Conversations API's)",
        ("ALTER TABLE chats ADD IF NOT EXISTS metadata frozen<map<text, text>>",),
    ),
    Migration(
        14,
        "message_children: each message under its parent (a branch page's versions; memory_store/messages.py)",
        (
            # Messages stored before this table have no row: their versions are not known (count 0).
            """CREATE TABLE IF NOT EXISTS message_children (
                chat_id timeuuid,
                parent_id timeuuid,
                message_id timeuuid,
                PRIMARY KEY ((chat_id), parent_id, message_id))""",
        ),
    ),
)

_KEYSPACE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


def replication_cql(replication: Mapping[str, str | int]) -> str:
    """A CQL replication map, e.g. {'class': 'SimpleStrategy', 'replication_factor': '1'}."""
    parts = []
    for key, value in replication.items():
        if not re.fullmatch(r"[A-Za-z0-9_.]+", str(key)) or not re.fullmatch(r"[A-Za-z0-9_.]+", str(value)):
            raise ValueError(f"invalid replication setting {key!r}: {value!r}")
        parts.append(f"'{key}': '{value}'")
    return "{" + ", ".join(parts) + "}"


def _cql(text: str) -> SimpleStatement:
    # Every schema statement is IF NOT EXISTS or an upsert: safe to retry.
    return SimpleStatement(text, is_idempotent=True)


async def apply(db: Db, keyspace: str, replication: Mapping[str, str | int]) -> list[int]:
    """Creates the keyspace if needed and applies new migrations; returns the versions applied."""
    if not _KEYSPACE_NAME.match(keyspace):
        raise ValueError(f"invalid keyspace name {keyspace!r}")
    # DDL only for what is missing, so a start against an up-to-date keyspace changes no schema and
    # needs no agreement (it must work with a node down).
    existing = db.cluster.metadata.keyspaces.get(keyspace)
    if existing is None:
        await db.execute(
            _cql(
                f"CREATE KEYSPACE IF NOT EXISTS {keyspace} WITH replication = {replication_cql(replication)}"
            ),
            operation="schema",
            timeout_s=DDL_TIMEOUT_S,
        )
    await db.use_keyspace(keyspace)
    if existing is None or "schema_migrations" not in existing.tables:
        await db.execute(
            _cql(
                """CREATE TABLE IF NOT EXISTS schema_migrations (
                    version int PRIMARY KEY,
                    description text,
                    applied_at timestamp)"""
            ),
            operation="schema",
            timeout_s=DDL_TIMEOUT_S,
        )
        await db.await_schema_agreement(DDL_TIMEOUT_S)
    done = {
        row["version"]
        for row in await db.execute(_cql("SELECT version FROM schema_migrations"), operation="schema")
    }
    applied = []
    for migration in MIGRATIONS:
        if migration.version in done:
            continue
        for statement in migration.statements:
            await db.execute(_cql(statement), operation="schema", timeout_s=DDL_TIMEOUT_S)
        await db.await_schema_agreement(DDL_TIMEOUT_S)
        await db.execute(
            _cql("INSERT INTO schema_migrations (version, description, applied_at) VALUES (%s, %s, %s)"),
            (migration.version, migration.description, datetime.now(UTC)),
            operation="schema",
        )
        applied.append(migration.version)
    return applied


async def pending(db: Db, keyspace: str) -> list[int]:
    """Migration versions not yet applied to ``keyspace`` (all of them when it does not exist); reads only."""
    if not _KEYSPACE_NAME.match(keyspace):
        raise ValueError(f"invalid keyspace name {keyspace!r}")
    meta = db.cluster.metadata.keyspaces.get(keyspace)
    if meta is None or "schema_migrations" not in meta.tables:
        return [migration.version for migration in MIGRATIONS]
    rows = await db.execute(_cql(f"SELECT version FROM {keyspace}.schema_migrations"), operation="schema")
    done = {row["version"] for row in rows}
    return [migration.version for migration in MIGRATIONS if migration.version not in done]
