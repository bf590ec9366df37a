"""``python -m localmesh.cassandra``: the local Cassandra node of development and tests.

    python -m localmesh.cassandra run       # foreground; Ctrl-C drains and stops it
    python -m localmesh.cassandra start     # in the background; returns once CQL answers
    python -m localmesh.cassandra status
    python -m localmesh.cassandra stop      # drain, then SIGTERM

The node keeps its data in ``.run/cassandra`` unless ``--data-dir`` says otherwise; ``make run`` starts
its own node in ``.run/mesh/cassandra``. Schema migrations are the data package's
(``python -m memory_store schema``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from localmesh.cassandra.node import (
    PROJECT_ROOT,
    CassandraNode,
    CqlAnswers,
    NodeConfig,
    NodeSetupError,
    rss_mib,
)
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
    """(supervisor pid, cassandra pid) of a running ``run``, or None."""
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
            f"log: {launcher.log_dir / 'cassandra.log'}; Ctrl-C or `python -m localmesh.cassandra stop` "
            "drains and stops it",
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
    """Starts ``run`` detached and returns once CQL answers."""
    if _read_pids(config):
        print(f"Cassandra is already running for {config.data_dir}")
        return 0
    config.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = config.data_dir / "node.out"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "localmesh.cassandra", "run", *argv],
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m localmesh.cassandra",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=["run", "start", "stop", "status"])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--cql-port", type=int, default=9042)
    parser.add_argument("--storage-port", type=int, default=7000)
    parser.add_argument("--jmx-port", type=int, default=7199)
    parser.add_argument("--heap", default="1g", help="maximum Java heap")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    config = node_config(args)
    if args.action == "run":
        return run(config)
    if args.action == "start":
        flags = list(argv)
        flags.remove("start")
        return start(config, flags)
    if args.action == "stop":
        return stop(config)
    return status(config)


if __name__ == "__main__":
    sys.exit(main())
