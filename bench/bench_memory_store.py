"""memory_store on a local Cassandra node: append latency, "load the last 50 turns" latency, and what each
step of a stored send costs the node in CPU.

Starts a private single-node Cassandra (the same configuration as ``make run``: commitlog_sync batch,
so every acknowledged append is fsynced), then measures through the public ``MemoryStore`` API:

- append: ``append_message`` of a ~1 KiB message (ownership read, parent check, message write and
  the chat's activity move), one chat at a time and 50 chats at once;
- last 50 turns: ``list_messages(limit=50)`` (a history page) and ``get_branch(max_messages=50)`` (what
  prompt assembly reads), on chats of 200 messages, one chat at a time and 50 chats at once.

- a send's steps (``--sends`` sends, 10 at a time, each by a user of its own with a chat of two
  turns), in the orchestrator's order, each step for every send before the next: the key's claim
  (Paxos), the reads for the prompt (branch and summary), the budget's reservation (the window's read
  and the estimate's write), the question and
  the run (one logged batch), one output checkpoint, the finish (a conditional batch, then the answer
  and its search entry, the usage and the index cleanup). For each: the node's CPU (user + system,
  every thread, from /proc) and this client's, per step, and its latency; on the fresh node, then
  again after ``--warm-sends`` more (a fresh JVM spends most of its CPU compiling at first).
- the budget's window read for a user with N runs in the window (``--budget-runs``): the plain read
  (every run of the window) and the orchestrator's (``Budgets.window``: the settled runs' sum kept,
  the runs made in the last ``usage_settled_after_s`` read: 22 minutes by default), ``--budget-reads`` reads each,
  one at a time, with the user's runs spread evenly over the last day. The store here uses 7-day
  windows so that a day of runs fits one window whatever the hour (windows are aligned to the epoch).

A warm-up of the same operations runs first and is not reported (a fresh JVM compiles as it goes).

Run it alone (``flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_memory_store.py``): the
numbers are the client's view, including the Python driver, and move with anything else on the box.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from bench.private_node import private_node  # noqa: E402
from bench.process_usage import cpu_seconds  # noqa: E402
from chatmesh.finish import FinishReason, Usage  # noqa: E402
from localmesh.cassandra.node import rss_mib  # noqa: E402
from memory_store.config import StoreConfig  # noqa: E402
from memory_store.ids import new_id  # noqa: E402
from memory_store.models import (  # noqa: E402
    Chat,
    Message,
    NewRun,
    Role,
    Run,
    RunDelta,
    RunOutcome,
    RunStatus,
)
from memory_store.store import MemoryStore  # noqa: E402
from orchestrator.config import BudgetConfig, RunConfig  # noqa: E402
from orchestrator.policy.admission import Budgets  # noqa: E402
from orchestrator.runs.relay import usage_settled_after_s  # noqa: E402

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


@dataclass
class Send:
    """One send's ids and state as its steps go (what the orchestrator holds between them)."""

    user: str
    chat_id: str
    parent_id: str
    key: str = ""
    run_id: str = ""
    user_message_id: str = ""
    assistant_message_id: str = ""
    chat: Chat | None = None
    run: Run | None = None


ANSWER = [RunDelta(2 + i, f" word{i}", 1, (1000 + i,)) for i in range(32)]


async def send_steps(
    store: MemoryStore, sends: int, node_pid: int | None
) -> list[tuple[str, float, float, float]]:
    """(step, node CPU ms, client CPU ms, p50 latency ms) per step of a send, each over every send (the
    node's CPU read from /proc when its pid is given, else 0)."""
    users = [f"bench-send-{new_id().hex}" for _ in range(sends)]
    chats = await asyncio.gather(*(chat_with_history(store, user, 2) for user in users))
    state = [Send(user, chat_id, leaf) for user, (chat_id, leaf) in zip(users, chats, strict=True)]
    gate = asyncio.Semaphore(10)

    async def claim(send: Send) -> None:
        send.key = new_id().hex
        claim = await store.claim_idempotency_key(send.user, send.key, b"fingerprint", 60)
        send.run_id, send.user_message_id = claim.run_id, claim.user_message_id
        send.assistant_message_id = claim.assistant_message_id

    async def read_prompt(send: Send) -> None:
        send.chat = (await store.get_branch(send.user, send.chat_id, None, with_summary=True)).chat

    async def reserve(send: Send) -> None:
        await store.get_usage(send.user)
        await store.record_usage(send.user, send.run_id, Usage(prompt_tokens=400, completion_tokens=64))

    async def store_question(send: Send) -> None:
        asked = Message(
            send.user_message_id, send.chat_id, Role.USER, USER_TEXT, send.parent_id, 200, run_id=send.run_id
        )
        assert send.chat is not None
        new = NewRun(
            send.user,
            send.chat_id,
            run_id=send.run_id,
            parent_message_id=send.user_message_id,
            assistant_message_id=send.assistant_message_id,
            model="bench",
            owner_id="bench-replica",
            user_message_id=send.user_message_id,
            prompt_tokens=400,
        )
        send.run = await store.create_run_with_question(new, asked, send.chat)

    async def checkpoint(send: Send) -> None:
        assert send.run is not None
        await store.checkpoint_runs([(send.run, ANSWER[:16])])

    async def finish(send: Send) -> None:
        assert send.run is not None
        outcome = RunOutcome(
            RunStatus.COMPLETED,
            last_seq=ANSWER[-1].seq + 2,
            finish_reason=FinishReason.STOP,
            tail=tuple(ANSWER[16:]),
            usage=Usage(prompt_tokens=400, completion_tokens=len(ANSWER)),
        )
        await store.finish_run(send.run, outcome, ANSWER)

    results = []
    for name, step in (
        ("claim (Paxos)", claim),
        ("prompt reads", read_prompt),
        ("budget reservation", reserve),
        ("question + run (batch)", store_question),
        ("checkpoint", checkpoint),
        ("finish + answer", finish),
    ):
        samples: list[float] = []

        async def one(
            send: Send, step: Callable[[Send], Awaitable[None]] = step, samples: list[float] = samples
        ) -> None:
            async with gate:
                await timed(lambda: step(send), samples)

        node_before, client_before = cpu_seconds(node_pid) if node_pid else 0.0, time.process_time()
        await asyncio.gather(*(one(send) for send in state))
        node_ms = ((cpu_seconds(node_pid) if node_pid else 0.0) - node_before) * 1000 / sends
        client_ms = (time.process_time() - client_before) * 1000 / sends
        results.append((name, node_ms, client_ms, statistics.median(samples) * 1000))
    return results


async def budget_reads(
    store: MemoryStore, runs: int, reads: int, node_pid: int
) -> list[tuple[str, float, float, float]]:
    """(read, node CPU ms, client CPU ms, p50 ms) per budget window read of a user with ``runs`` runs
    spread over the last day: the plain read, then the orchestrator's."""
    user = f"bench-budget-{new_id().hex}"
    now = datetime.now(UTC)
    made = [now - timedelta(days=1) * i / runs for i in range(runs)]
    gate = asyncio.Semaphore(50)

    async def record(at: datetime) -> None:
        async with gate:
            await store.record_usage(user, str(new_id(at)), Usage(prompt_tokens=400, completion_tokens=64))

    await asyncio.gather(*(record(at) for at in made))
    budgets = Budgets(store, BudgetConfig(), usage_settled_after_s(RunConfig()))
    results = []
    for name, read in (
        ("plain (every run)", lambda: store.get_usage(user)),
        ("settled sum + recent runs", lambda: budgets.window(user)),
    ):
        for _ in range(20):  # the orchestrator's first read folds the settled runs, behind it
            await read()
        samples: list[float] = []
        node_before, client_before = cpu_seconds(node_pid), time.process_time()
        for _ in range(reads):
            await timed(read, samples)
        node_ms = (cpu_seconds(node_pid) - node_before) * 1000 / reads
        results.append(
            (
                name,
                node_ms,
                (time.process_time() - client_before) * 1000 / reads,
                statistics.median(samples) * 1000,
            )
        )
    return results


async def warm_node(store: MemoryStore, sends: int) -> None:
    """Runs ``sends`` sends' statements on the node, 500 at a time: a fresh JVM spends most of its CPU
    compiling for its first thousands of them, which a node that has served a while no longer does."""
    for _ in range(0, sends, 500):
        await send_steps(store, 500, None)


async def bench(args: argparse.Namespace) -> None:
    print(f"machine: {machine()}")
    with private_node("bench-cassandra-") as (config, report):
        version = next(config.lib_dir.glob("cassandra-all-*.jar")).stem.removeprefix("cassandra-all-")
        print(
            f"node: Apache Cassandra {version}, single node on 127.0.0.1, heap {config.heap_min}..{config.heap_max}, "
            f"commitlog_sync batch (fsync before ack), started in {report.startup_s:.1f}s, RSS {report.rss_mib:.0f} MiB"
        )
        print("client: MemoryStore (DataStax driver, libev, LOCAL_QUORUM, prepared statements)")
        store = await MemoryStore.connect(
            StoreConfig(port=config.cql_port, keyspace="bench", usage_window_s=7 * 86_400)
        )
        try:
            results = await run_workloads(store, args.appends, args.reads)
            fresh = await send_steps(store, args.sends, report.pid)
            await warm_node(store, args.warm_sends)
            warm = await send_steps(store, args.sends, report.pid)
            budget = [
                (runs, await budget_reads(store, runs, args.budget_reads, report.pid))
                for runs in args.budget_runs
            ]
        finally:
            await store.close()
        print(f"node RSS after the run: {rss_mib(report.pid):.0f} MiB")
    print()
    print(f"{'operation':<30} {'chats':>5} {'ops':>6} {'p50 ms':>8} {'p99 ms':>8} {'ops/s':>8}")
    for name, concurrency, samples, wall in results:
        print(
            f"{name:<30} {concurrency:>5} {len(samples):>6} {statistics.median(samples) * 1000:>8.2f} "
            f"{percentile(samples, 0.99) * 1000:>8.2f} {len(samples) / wall:>8.0f}"
        )
    print()
    print(
        f"a send's steps: {args.sends} sends, 10 at a time, on the fresh node (after the runs above) and "
        f"again after {args.warm_sends:,} more sends; CPU ms per step (node, this client) and p50 ms"
    )
    print(
        f"{'step':<26} {'fresh: node CPU':>16} {'client':>7} {'p50':>7} {'warm: node CPU':>15} {'client':>7} {'p50':>7}"
    )
    for before, after in zip(fresh, warm, strict=True):
        print(
            f"{before[0]:<26} {before[1]:>16.2f} {before[2]:>7.2f} {before[3]:>7.2f} "
            f"{after[1]:>15.2f} {after[2]:>7.2f} {after[3]:>7.2f}"
        )
    print(
        f"{'a send, all steps':<26} {sum(step[1] for step in fresh):>16.2f} {sum(step[2] for step in fresh):>7.2f} "
        f"{'':>7} {sum(step[1] for step in warm):>15.2f} {sum(step[2] for step in warm):>7.2f}"
    )
    print()
    print(
        f"the budget's window read, warm node, {args.budget_reads} reads one at a time, of a user whose runs "
        "spread over the last day; CPU ms per read (node, this client) and p50 ms"
    )
    print(f"{'runs in window':>14}  {'read':<26} {'node CPU':>9} {'client':>7} {'p50':>7}")
    for runs, rows in budget:
        for name, node_ms, client_ms, p50 in rows:
            print(f"{runs:>14,}  {name:<26} {node_ms:>9.2f} {client_ms:>7.2f} {p50:>7.2f}")


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
    parser.add_argument("--sends", type=int, default=300, help="sends whose steps are measured")
    parser.add_argument(
        "--warm-sends", type=int, default=6000, help="sends between the fresh and the warm measure"
    )
    parser.add_argument(
        "--budget-runs", type=int, nargs="*", default=[10, 100, 1000, 4000], help="runs in the budget window"
    )
    parser.add_argument("--budget-reads", type=int, default=200, help="budget window reads measured each")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
