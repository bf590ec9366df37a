"""What each kind of request a stored send makes costs a Cassandra node in CPU: a plain write against a
lightweight transaction (the send's claim, ``IF NOT EXISTS``; its finish, ``IF status AND owner``), and a
logged batch across two partitions (the question and its run) against the same batch unlogged.

Starts a private single-node Cassandra (the configuration of ``make run``: Paxos v2, commitlog_sync
batch), makes a keyspace of three small tables shaped like memory_store's (keys, messages, runs), then
runs ``--requests`` requests of each kind, ``--in-flight`` at a time, kind after kind, for ``--rounds``
rounds; the first ``--warm-rounds`` only warm the JVM (its JIT compiles for thousands of requests). Each
kind's node CPU (every thread, /proc) is divided by its requests, its JIT compiler threads apart, and
printed as the median over the measured rounds with their range. The client is the DataStax driver
straight (no memory_store code), so the node's numbers are its own; the client's CPU a request (this
process, every thread: what the driver alone spends on a request, before any of the orchestrator's code)
is printed beside them.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_cassandra_requests.py \\
        [--requests 2000] [--in-flight 16] [--rounds 6] [--warm-rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cassandra.cluster import Cluster, Session  # noqa: E402
from cassandra.concurrent import execute_concurrent  # noqa: E402
from cassandra.query import BatchStatement, BatchType  # noqa: E402

from bench.machine import machine  # noqa: E402
from bench.private_node import private_node  # noqa: E402
from bench.process_usage import compiler_seconds, cpu_seconds  # noqa: E402

BODY = "x" * 200  # about a short message's text
SCHEMA = (
    "CREATE KEYSPACE bench WITH replication = {'class': 'SimpleStrategy', 'replication_factor': 1}",
    "CREATE TABLE bench.keys (user_id text, key text, body text, run_id uuid, PRIMARY KEY ((user_id), key))",
    "CREATE TABLE bench.messages (chat_id uuid, message_id timeuuid, body text, PRIMARY KEY ((chat_id), message_id))",
    "CREATE TABLE bench.runs (run_id uuid PRIMARY KEY, status text, owner_id text, body text)",
)
# A request: a statement (or batch) and its values, as execute_concurrent takes them.
Request = tuple[Any, Any]


@dataclass(frozen=True)
class Kind:
    """A kind of request: the request(s) its i-th sends, and what must exist before (off the clock)."""

    make: Callable[[int], list[Request]]
    before: Callable[[int], list[Request]] = lambda i: []


def request_kinds(session: Session) -> dict[str, Kind]:
    """The kinds measured, by name."""
    key_insert = session.prepare("INSERT INTO bench.keys (user_id, key, body, run_id) VALUES (?, ?, ?, ?)")
    key_claim = session.prepare(
        "INSERT INTO bench.keys (user_id, key, body, run_id) VALUES (?, ?, ?, ?) IF NOT EXISTS"
    )
    message_insert = session.prepare(
        "INSERT INTO bench.messages (chat_id, message_id, body) VALUES (?, now(), ?)"
    )
    run_insert = session.prepare(
        "INSERT INTO bench.runs (run_id, status, owner_id, body) VALUES (?, 'in_progress', 'o', ?)"
    )
    run_update = session.prepare("UPDATE bench.runs SET status = 'completed' WHERE run_id = ?")
    run_finish = session.prepare(
        "UPDATE bench.runs SET status = 'completed' WHERE run_id = ? IF status = 'in_progress' AND owner_id = 'o'"
    )

    def key(statement: Any) -> Kind:
        return Kind(lambda i: [(statement, (f"user-{i % 997}", uuid.uuid4().hex, BODY, uuid.uuid4()))])

    def batch(kind: BatchType) -> Kind:
        def make(i: int) -> list[Request]:
            both = BatchStatement(batch_type=kind)
            both.add(message_insert, (uuid.uuid4(), BODY))
            both.add(run_insert, (uuid.uuid4(), BODY))
            return [(both, None)]

        return Kind(make)

    def finish(statement: Any) -> Kind:
        # Ends a run in progress, made for it before the clock starts (again each round).
        return Kind(
            lambda i: [(statement, (uuid.UUID(int=i + 1),))],
            before=lambda i: [(run_insert, (uuid.UUID(int=i + 1), BODY))],
        )

    def apart(i: int) -> list[Request]:
        return [(message_insert, (uuid.uuid4(), BODY)), (run_insert, (uuid.uuid4(), BODY))]

    return {
        "insert": key(key_insert),
        "insert IF NOT EXISTS (claim)": key(key_claim),
        "update": finish(run_update),
        "update IF status AND owner (finish)": finish(run_finish),
        "two inserts, apart (the pair)": Kind(apart),
        "batch of two partitions, unlogged": batch(BatchType.UNLOGGED),
        "batch of two partitions, logged": batch(BatchType.LOGGED),
    }


@dataclass(frozen=True)
class Measured:
    """Milliseconds a request of one kind, over one round."""

    node_cpu: float  # the node's CPU, its JIT compilers apart
    node_jit: float
    client_cpu: float  # this process's CPU: the driver's
    wall: float


def measure(session: Session, pid: int, kind: Kind, count: int, in_flight: int) -> Measured:
    """What a request of ``kind`` costs, ``count`` of them."""
    first = [request for i in range(count) for request in kind.before(i)]
    execute_concurrent(session, first, concurrency=in_flight, raise_on_first_error=True)
    requests = [request for i in range(count) for request in kind.make(i)]
    cpu, jit, client, began = (
        cpu_seconds(pid),
        compiler_seconds(pid),
        time.process_time(),
        time.perf_counter(),
    )
    execute_concurrent(session, requests, concurrency=in_flight, raise_on_first_error=True)
    wall, client_cpu = time.perf_counter() - began, time.process_time() - client
    spent_jit = compiler_seconds(pid) - jit
    per_request = 1e3 / count
    return Measured(
        node_cpu=(cpu_seconds(pid) - cpu - spent_jit) * per_request,
        node_jit=spent_jit * per_request,
        client_cpu=client_cpu * per_request,
        wall=wall * per_request,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests of each kind a round")
    parser.add_argument("--in-flight", type=int, default=16, help="requests in flight at once")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warm-rounds", type=int, default=2, help="first rounds, not reported")
    args = parser.parse_args()
    if args.rounds <= args.warm_rounds:
        parser.error("--rounds must be more than --warm-rounds")
    print(f"machine: {machine()}")
    with private_node("bench-cassandra-requests-") as (config, report):
        print(
            f"node: single Cassandra node on 127.0.0.1 (make run's configuration), started in {report.startup_s:.1f}s"
        )
        cluster = Cluster(["127.0.0.1"], port=config.cql_port)
        try:
            session = cluster.connect()
            for statement in SCHEMA:
                session.execute(statement)
            kinds = request_kinds(session)
            measured: dict[str, list[Measured]] = {name: [] for name in kinds}
            for round_ in range(args.rounds):
                for name, kind in kinds.items():
                    result = measure(session, report.pid, kind, args.requests, args.in_flight)
                    if round_ >= args.warm_rounds:
                        measured[name].append(result)
        finally:
            cluster.shutdown()
    print(
        f"\n{args.requests:,} requests a kind a round, {args.in_flight} in flight, {args.rounds - args.warm_rounds} "
        f"rounds measured after {args.warm_rounds} warming; ms a request, median (range)"
    )
    print(f"{'request':<38} {'node CPU':>20} {'its JIT':>8} {'client CPU':>20} {'wall':>7}")
    for name, results in measured.items():
        node_ms = [r.node_cpu for r in results]
        client_ms = [r.client_cpu for r in results]
        print(
            f"{name:<38} {statistics.median(node_ms):>7.3f} ({min(node_ms):.3f}-{max(node_ms):.3f})"
            f" {statistics.median(r.node_jit for r in results):>8.3f}"
            f" {statistics.median(client_ms):>7.3f} ({min(client_ms):.3f}-{max(client_ms):.3f})"
            f" {statistics.median(r.wall for r in results):>7.3f}"
        )


if __name__ == "__main__":
    main()
