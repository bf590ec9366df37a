"""``python -m memory_store``: apply the schema, and index for search what was written before it.

    python -m memory_store schema         # apply schema migrations (a deploy job in production)
    python -m memory_store schema --check # exit 0 when every migration is applied, 3 when some are not
    python -m memory_store search-backfill  # index chats written before search existed (once, re-runnable)

The local Cassandra node of development and tests is the developer tools' (``python -m localmesh.cassandra``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from memory_store import schema
from memory_store.config import StoreConfig, parse_replication
from memory_store.db import Db
from memory_store.errors import MemoryStoreError
from memory_store.search_backfill import backfill_search
from memory_store.security import CassandraSecurity
from memory_store.store import MemoryStore
from meshkit.config import ServiceArgs, from_flags


async def apply_schema(args: argparse.Namespace) -> int:
    security = from_flags(CassandraSecurity, args)
    db = await Db.connect(args.hosts.split(","), args.cql_port, args.local_dc, 30.0, security)
    try:
        if args.check:
            # Replicas wait on this (the Helm chart's init container) while the schema Job applies them.
            missing = await schema.pending(db, args.keyspace)
            print(f"keyspace {args.keyspace}: {f'migrations {missing} pending' if missing else 'up to date'}")
            return 3 if missing else 0
        applied = await schema.apply(db, args.keyspace, parse_replication(args.replication))
    finally:
        await db.close()
    print(f"keyspace {args.keyspace}: applied migrations {applied or 'none (up to date)'}")
    return 0


async def search_backfill(args: argparse.Namespace) -> int:
    config = StoreConfig(
        contact_points=tuple(args.hosts.split(",")),
        port=args.cql_port,
        keyspace=args.keyspace,
        local_dc=args.local_dc,
        apply_schema=False,
        security=from_flags(CassandraSecurity, args),
    )
    store = await MemoryStore.connect(config)
    try:
        chats, messages = await backfill_search(store)
    finally:
        await store.close()
    print(f"keyspace {args.keyspace}: indexed {chats} chats and {messages} messages for search")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m memory_store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    migrate = commands.add_parser("schema", help="apply schema migrations")
    backfill = commands.add_parser("search-backfill", help="index chats written before search existed")
    for command in (migrate, backfill):
        command.add_argument("--hosts", default="127.0.0.1")
        command.add_argument("--cql-port", type=int, default=9042)
        command.add_argument("--keyspace", default="chatmesh")
        command.add_argument("--local-dc", default="datacenter1")
    migrate.add_argument(
        "--replication",
        default="SimpleStrategy:1",
        help="SimpleStrategy:<rf> or NetworkTopologyStrategy:<dc>=<rf>,...",
    )
    migrate.add_argument(
        "--check", action="store_true", help="apply nothing; exit 3 while migrations are pending"
    )
    # Credentials and TLS as every service takes them (env CHATMESH_MEMORY_STORE_CASSANDRA_...).
    for command in (migrate, backfill):
        ServiceArgs("memory_store", "", parser=command).add_config(CassandraSecurity)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        return asyncio.run((apply_schema if args.command == "schema" else search_backfill)(args))
    except (MemoryStoreError, ValueError, OSError) as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
