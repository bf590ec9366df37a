"""memory_store on a local Cassandra node: append latency and "load the last 50 turns" latency.

Starts a private single-node Cassandra (the same configuration as ``make run``: commitlog_sync batch,
so every acknowledged append is fsynced), then measures through the public ``MemoryStore`` API:

- append: ``append_message`` of a ~1 KiB message (ownership read, parent check, message write and
  the chat's activity move), one chat at a time and 50 chats at once;
- last 50 turns: ``list_messages(limit=50)`` (a history page) and ``get_branch(max_messages=50)`` (what
  prompt assembly reads), on chats of 200 messages, one chat at a time and 50 chats at once.

A warm-up of the same operations runs first and is not reported (a fresh JVM compiles as it goes).

Run it alone (``flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_memory_store.py``): the
numbers are the client's view, including the Python driver, and move with anything else on the box.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from machine import machine

from memory_store.config import StoreConfig
from memory_store.ids import new_id
from memory_store.models import Message, Role
from memory_store.node import CassandraNode, NodeConfig, rss_mib
from memory_store.store import MemoryStore
from meshkit.launcher import Launcher, free_port

WARMUP_APPENDS = 1000
WARMUP_READS = 400
USER_TEXT = "How do I make my sourdough starter more active in a cold kitchen? " * 14  # ~0.9 KiB


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def timed(op: Callable[[], Awaitable[object]], out: list[float]) -> None:
    started = time.perf_counter()
    await op()
    out.append(time.perf_counter() - started)


async def chat_with_history(store: MemoryStore, user: str, turns: int) -> tuple[str, str]:
    """A chat whose branch is ``turns`` messages long; returns (chat id, newest message id)."""
    chat = await store.create_chat(user, "bench")
    parent = None
    for i in range(turns):
        role = Role.USER if i % 2 == 0 else Role.ASSISTANT
        parent = await store.append_message(
            user, Message(str(new_id()), chat.chat_id, role, USER_TEXT, parent.message_id if parent else None)
        )
    return chat.chat_id, parent.message_id


async def run_workloads(
    store: MemoryStore, appends: int, reads: int
) -> list[tuple[str, int, list[float], float]]:
    results = []

    async def appenders(concurrency: int, per_chat: int) -> None:
        chats = [
            await store.create_chat(f"bench-append-{concurrency}-{i}", "bench") for i in range(concurrency)
        ]
        samples: list[float] = []

        async def one_chat(user: str, chat_id: str) -> None:
            parent = None
            for _ in range(per_chat):
                msg = Message(str(new_id()), chat_id, Role.USER, USER_TEXT, parent)
                await timed(lambda m=msg, u=user: store.append_message(u, m), samples)
                parent = msg.message_id

        started = time.perf_counter()
        await asyncio.gather(*(one_chat(c.user_id, c.chat_id) for c in chats))
        results.append(("append_message", concurrency, samples, time.perf_counter() - started))

    async def readers(concurrency: int, per_chat: int) -> None:
        chats = await asyncio.gather(
            *(chat_with_history(store, f"bench-read-{concurrency}-{i}", 200) for i in range(concurrency))
        )
        for name in ("list_messages(limit=50)", "get_branch(max_messages=50)"):
            samples: list[float] = []

            async def one_chat(
                user: str, chat_id: str, leaf: str, name: str = name, samples: list[float] = samples
            ) -> None:
                for _ in range(per_chat):
                    if name.startswith("list"):
                        op = lambda: store.list_messages(user, chat_id, limit=50)  # noqa: E731
                    else:
                        op = lambda: store.get_branch(user, chat_id, leaf, max_messages=50)  # noqa: E731
                    await timed(op, samples)

            started = time.perf_counter()
            await asyncio.gather(
                *(one_chat(f"bench-read-{concurrency}-{i}", c, leaf) for i, (c, leaf) in enumerate(chats))
            )
            results.append((name, concurrency, samples, time.perf_counter() - started))

    # Warm-up (not reported): a fresh JVM spends its first thousands of requests compiling.
    await appenders(10, WARMUP_APPENDS // 10)
    await readers(10, WARMUP_READS // 10)
    results.clear()
    await appenders(1, appends)
    await appenders(50, max(1, appends // 10))
    await readers(1, reads)
    await readers(50, max(1, reads // 10))
    return results


async def bench(args: argparse.Namespace) -> None:
    print(f"machine: {machine()}")
    with (
        tempfile.TemporaryDirectory(prefix="bench-cassandra-") as tmp,
        Launcher(Path(tmp) / "run", echo=lambda _: None) as launcher,
    ):
        config = NodeConfig(
            data_dir=Path(tmp) / "data", cql_port=free_port(), storage_port=free_port(), jmx_port=free_port()
        )
        node = CassandraNode(config, launcher)
        report = node.start()
        version = next(config.lib_dir.glob("cassandra-all-*.jar")).stem.removeprefix("cassandra-all-")
        print(
            f"node: Apache Cassandra {version}, single node on 127.0.0.1, heap {config.heap_min}..{config.heap_max}, "
            f"commitlog_sync batch (fsync before ack), started in {report.startup_s:.1f}s, RSS {report.rss_mib:.0f} MiB"
        )
        print("client: MemoryStore (DataStax driver, libev, LOCAL_QUORUM, prepared statements)")
        store = await MemoryStore.connect(StoreConfig(port=config.cql_port, keyspace="bench"))
        try:
            results = await run_workloads(store, args.appends, args.reads)
        finally:
            await store.close()
        print(f"node RSS after the run: {rss_mib(report.pid):.0f} MiB")
        node.stop()
    print()
    print(f"{'operation':<30} {'chats':>5} {'ops':>6} {'p50 ms':>8} {'p99 ms':>8} {'ops/s':>8}")
    for name, concurrency, samples, wall in results:
        print(
            f"{name:<30} {concurrency:>5} {len(samples):>6} {statistics.median(samples) * 1000:>8.2f} "
            f"{percentile(samples, 0.99) * 1000:>8.2f} {len(samples) / wall:>8.0f}"
        )


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--appends", type=int, default=500, help="appends by the single chat (50 chats: /10 each)"
    )
    parser.add_argument(
        "--reads", type=int, default=300, help="reads of the single chat (50 chats: /10 each)"
    )
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
