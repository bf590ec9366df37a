"""``python -m memory_store``: run the local Cassandra node and apply the schema.

    python -m memory_store node run       # foreground; Ctrl-C drains and stops it
    python -m memory_store node start     # in the background; returns once CQL answers
    python -m memory_store node status
    python -m memory_store node stop      # drain, then SIGTERM
    python -m memory_store schema         # apply schema migrations (a deploy job in production)
    python -m memory_store schema --check # exit 0 when every migration is applied, 3 when some are not

The node keeps its data in ``.run/cassandra`` unless ``--data-dir`` says otherwise; ``make run`` starts
its own node in ``.run/mesh/cassandra``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from memory_store import schema
from memory_store.config import parse_replication
from memory_store.db import Db
from memory_store.errors import MemoryStoreError
from memory_store.node import PROJECT_ROOT, CassandraNode, CqlAnswers, NodeConfig, NodeSetupError, rss_mib
from memory_store.security import CassandraSecurity
from meshkit.config import ServiceArgs, from_flags
from meshkit.launcher import Launcher, ServiceFailedError
from meshkit.serving import PortInUseError

DEFAULT_DATA_DIR = PROJECT_ROOT / ".run" / "cassandra"


def node_config(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        data_dir=args.data_dir.resolve(),
        cql_port=args.cql_port,
        storage_port=args.storage_port,
        jmx_port=args.jmx_port,
        heap_max=args.heap,
    )


def _pid_file(config: NodeConfig) -> Path:
    return config.data_dir / "node.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _read_pids(config: NodeConfig) -> tuple[int, int] | None:
    """(supervisor pid, cassandra pid) of a running ``node run``, or None."""
    try:
        supervisor, cassandra = (int(p) for p in _pid_file(config).read_text().split())
    except (OSError, ValueError):
        return None
    return (supervisor, cassandra) if _alive(supervisor) else None


def run(config: NodeConfig) -> int:
    """Runs the node in the foreground until SIGINT/SIGTERM, then drains and stops it."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Launcher(config.data_dir / "run") as launcher:
        node = CassandraNode(config, launcher)
        try:
            report = node.start()
        except (NodeSetupError, PortInUseError, ServiceFailedError) as exc:
            print(f"ERROR: {exc}", file=sys.stderr)
            return 1
        _pid_file(config).write_text(f"{os.getpid()} {report.pid}\n")
        print(
            f"log: {launcher.log_dir / 'cassandra.log'}; Ctrl-C or `node stop` drains and stops it",
            flush=True,
        )
        try:
            while not stop.wait(1.0):
                running = launcher.running.get(node.name)
                if running is None or running.process.poll() is not None:
                    print(
                        f"ERROR: Cassandra exited; see {launcher.log_dir / 'cassandra.log'}", file=sys.stderr
                    )
                    return 1
            node.stop()
        finally:
            _pid_file(config).unlink(missing_ok=True)
    return 0


def start(config: NodeConfig, argv: list[str]) -> int:
    """Starts ``node run`` detached and returns once CQL answers."""
    if _read_pids(config):
        print(f"Cassandra is already running for {config.data_dir}")
        return 0
    config.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = config.data_dir / "node.out"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "memory_store", "node", "run", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    ready = CqlAnswers(config.cql_port)
    deadline = time.monotonic() + config.ready_timeout_s + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            print(
                f"ERROR: the node did not start; see {log_path}:\n{log_path.read_text()[-3000:]}",
                file=sys.stderr,
            )
            return 1
        if ready() and _read_pids(config):
            print(
                next(line for line in log_path.read_text().splitlines() if "Cassandra up in" in line).strip()
            )
            return status(config)
        time.sleep(0.5)
    print(f"ERROR: no CQL answer within the deadline; see {log_path}", file=sys.stderr)
    return 1


def stop(config: NodeConfig) -> int:
    pids = _read_pids(config)
    if pids is None:
        print(f"no Cassandra node is running for {config.data_dir}")
        return 0
    os.kill(pids[0], signal.SIGTERM)  # `node run` drains and stops Cassandra, then exits
    deadline = time.monotonic() + 180
    while _alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pids[0]):
        print("ERROR: the node did not stop within 180s", file=sys.stderr)
        return 1
    print("Cassandra drained and stopped")
    return 0


def status(config: NodeConfig) -> int:
    pids = _read_pids(config)
    if pids is None:
        print(f"stopped (data dir {config.data_dir})")
        return 3
    rss = rss_mib(pids[1])
    answers = "answers" if CqlAnswers(config.cql_port)() else "does NOT answer"
    print(
        f"running: pid {pids[1]}, RSS {rss:.0f} MiB, CQL 127.0.0.1:{config.cql_port} {answers}, "
        f"data {config.data_dir}"
    )
    return 0


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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m memory_store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    node = commands.add_parser("node", help="manage the local Cassandra node")
    node.add_argument("action", choices=["run", "start", "stop", "status"])
    node.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    node.add_argument("--cql-port", type=int, default=9042)
    node.add_argument("--storage-port", type=int, default=7000)
    node.add_argument("--jmx-port", type=int, default=7199)
    node.add_argument("--heap", default="1g", help="maximum Java heap")
    migrate = commands.add_parser("schema", help="apply schema migrations")
    migrate.add_argument("--hosts", default="127.0.0.1")
    migrate.add_argument("--cql-port", type=int, default=9042)
    migrate.add_argument("--keyspace", default="chatmesh")
    migrate.add_argument(
        "--replication",
        default="SimpleStrategy:1",
        help="SimpleStrategy:<rf> or NetworkTopologyStrategy:<dc>=<rf>,...",
    )
    migrate.add_argument("--local-dc", default="datacenter1")
    migrate.add_argument(
        "--check", action="store_true", help="apply nothing; exit 3 while migrations are pending"
    )
    # Credentials and TLS as every service takes them (env CHATMESH_MEMORY_STORE_CASSANDRA_...).
    ServiceArgs("memory_store", "", parser=migrate).add_config(CassandraSecurity)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.command == "schema":
        try:
            return asyncio.run(apply_schema(args))
        except (MemoryStoreError, ValueError, OSError) as exc:
            print(f"ERROR: {exc}", file=sys.stderr)
            return 1
    config = node_config(args)
    if args.action == "run":
        return run(config)
    if args.action == "start":
        return start(config, argv[2:])
    if args.action == "stop":
        return stop(config)
    return status(config)


if __name__ == "__main__":
    sys.exit(main())
