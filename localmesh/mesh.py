"""``python -m localmesh.mesh`` (``make run``): the whole mesh on 127.0.0.1 under one supervisor.

Starts the services in dependency order, waits for each to be healthy, prints where to connect, then
restarts any service that dies (with backoff, logged: ``meshkit/supervisor.py``) until Ctrl-C stops
everything. Logs go to ``.run/mesh/logs/<service>.log``.

Each tier can run several replicas (``--orchestrators 2 --routers 2 --engines 3 --cassandra-nodes 3``).
Replica i of the orchestrator and router tiers listens ``REPLICA_PORT_STRIDE * i`` above the first one's
port; engines take consecutive ports. Every router follows every engine; orchestrator i uses router
i mod R; Envoy spreads chats over the orchestrators (ring hash on the chat id). Cassandra members listen
on 127.0.0.1 ... 127.0.0.N with the keyspace replicated to three of them (``memory_store/cluster.py``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from localmesh.dev_jwt import ensure_keys
from localmesh.front_door import FrontDoorPorts, front_door_specs, welcome
from memory_store.cluster import CassandraCluster, ClusterConfig
from memory_store.node import NodeSetupError
from meshkit.envoy import InvalidEnvoyConfigError
from meshkit.launcher import GrpcHealthy, Launcher, ServiceFailedError, ServiceSpec
from meshkit.serving import PortInUseError
from meshkit.supervisor import Supervisor

# Replica i of the orchestrator and router tiers listens this far above replica i - 1.
REPLICA_PORT_STRIDE = 100


@dataclass(frozen=True)
class MeshPorts:
    orchestrator: int = 50050
    router: int = 50051
    first_engine: int = 50061
    front_door: FrontDoorPorts = field(default_factory=FrontDoorPorts)
    cassandra: int = 9042
    cassandra_storage: int = 7000
    cassandra_jmx: int = 7199


def replica_name(tier: str, index: int, replicas: int) -> str:
    """``router`` when the tier has one replica, ``router-0``, ``router-1``, ... when it has more."""
    return tier if replicas == 1 else f"{tier}-{index}"


@dataclass(frozen=True)
class MeshConfig:
    ports: MeshPorts = MeshPorts()
    engines: int = 2
    orchestrators: int = 1
    routers: int = 1
    cassandra_nodes: int = 1
    engine_backend: str = "cpu"
    python: str = sys.executable
    # Whom the dev token printed at start-up speaks for.
    user: str = "alice"
    tier: str = "pro"
    cassandra_data_dir: Path = Path(".run/mesh/cassandra")

    def engine_ports(self) -> list[int]:
        return [self.ports.first_engine + i for i in range(self.engines)]

    def orchestrator_ports(self) -> list[int]:
        return [self.ports.orchestrator + REPLICA_PORT_STRIDE * i for i in range(self.orchestrators)]

    def router_ports(self) -> list[int]:
        return [self.ports.router + REPLICA_PORT_STRIDE * i for i in range(self.routers)]

    def cassandra_cluster(self) -> ClusterConfig:
        """The mesh's Cassandra: started first, before everything else; its data survives restarts."""
        return ClusterConfig(
            data_dir=self.cassandra_data_dir.resolve(),
            size=self.cassandra_nodes,
            cql_port=self.ports.cassandra,
            storage_port=self.ports.cassandra_storage,
            first_jmx_port=self.ports.cassandra_jmx,
        )


def mesh_specs(config: MeshConfig, run_dir: Path) -> list[ServiceSpec]:
    """The services of the local mesh, in start order."""
    py, ports = config.python, config.ports
    specs = [
        ServiceSpec(
            name=f"engine-{i}",
            argv=[
                py,
                "-m",
                "engine",
                "--port",
                str(port),
                "--engine-id",
                f"engine-{i}",
                "--backend",
                config.engine_backend,
            ],
            ports=(port,),
            ready=GrpcHealthy(port),
            ready_timeout_s=180,
        )
        for i, port in enumerate(config.engine_ports())
    ]
    # Named like the engines' --engine-id, so `routed` frames, logs and metrics agree on engine names.
    # Every router follows every engine (their KV events included).
    engine_flags = [
        flag
        for i, port in enumerate(config.engine_ports())
        for flag in ("--engine", f"engine-{i}=127.0.0.1:{port}")
    ]
    router_ports = config.router_ports()
    specs.extend(
        ServiceSpec(
            name=replica_name("router", i, config.routers),
            argv=[py, "-m", "router", "--port", str(port), *engine_flags],
            ports=(port,),
            ready=GrpcHealthy(port),
        )
        for i, port in enumerate(router_ports)
    )
    cassandra = config.cassandra_cluster()
    cassandra_flags = [
        *(flag for contact in cassandra.contact_points() for flag in ("--cassandra", contact)),
        *("--cassandra-replication", cassandra.replication_flag()),
    ]
    specs.extend(
        ServiceSpec(
            name=replica_name("orchestrator", i, config.orchestrators),
            argv=[
                py,
                "-m",
                "orchestrator",
                "--port",
                str(port),
                "--router",
                f"127.0.0.1:{router_ports[i % len(router_ports)]}",
                *cassandra_flags,
            ],
            ports=(port,),
            ready=GrpcHealthy(port),
        )
        for i, port in enumerate(config.orchestrator_ports())
    )
    # The front door: the edge, then Envoy in front of it and the orchestrator.
    specs.extend(front_door_specs(ports.front_door, config.orchestrator_ports(), run_dir, ensure_keys(), py))
    return specs


def parse_args(argv: list[str] | None = None) -> tuple[MeshConfig, Path]:
    defaults = MeshPorts()
    door = defaults.front_door
    parser = argparse.ArgumentParser(prog="python -m localmesh.mesh", description=__doc__)
    parser.add_argument("--edge-port", type=int, default=door.edge)
    parser.add_argument("--orchestrator-port", type=int, default=defaults.orchestrator)
    parser.add_argument("--router-port", type=int, default=defaults.router)
    parser.add_argument("--first-engine-port", type=int, default=defaults.first_engine)
    parser.add_argument("--envoy-port", type=int, default=door.envoy, help="the public port (browsers, gRPC)")
    parser.add_argument("--envoy-admin-port", type=int, default=door.envoy_admin)
    parser.add_argument("--envoy-internal-port", type=int, default=door.envoy_internal)
    parser.add_argument("--user", default="alice", help="who the printed token is for")
    parser.add_argument("--tier", default="pro", help="the printed token's tier")
    parser.add_argument("--cassandra-port", type=int, default=defaults.cassandra, help="CQL port")
    parser.add_argument("--cassandra-storage-port", type=int, default=defaults.cassandra_storage)
    parser.add_argument("--cassandra-jmx-port", type=int, default=defaults.cassandra_jmx)
    parser.add_argument("--engines", type=int, default=2, help="number of engine replicas")
    parser.add_argument("--orchestrators", type=int, default=1, help="number of orchestrator replicas")
    parser.add_argument("--routers", type=int, default=1, help="number of router replicas")
    parser.add_argument(
        "--cassandra-nodes", type=int, default=1, help="Cassandra cluster size (127.0.0.1 ... 127.0.0.N)"
    )
    parser.add_argument("--engine-backend", default="cpu", help="cpu (real model) or null (no compute)")
    parser.add_argument("--run-dir", type=Path, default=Path(".run/mesh"))
    args = parser.parse_args(argv)
    door = FrontDoorPorts(args.envoy_port, args.envoy_admin_port, args.envoy_internal_port, args.edge_port)
    ports = MeshPorts(
        args.orchestrator_port,
        args.router_port,
        args.first_engine_port,
        door,
        cassandra=args.cassandra_port,
        cassandra_storage=args.cassandra_storage_port,
        cassandra_jmx=args.cassandra_jmx_port,
    )
    config = MeshConfig(
        ports=ports,
        engines=args.engines,
        orchestrators=args.orchestrators,
        routers=args.routers,
        cassandra_nodes=args.cassandra_nodes,
        engine_backend=args.engine_backend,
        user=args.user,
        tier=args.tier,
        cassandra_data_dir=args.run_dir / "cassandra",
    )
    return config, args.run_dir


def main(argv: list[str] | None = None) -> int:
    config, run_dir = parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Launcher(run_dir) as launcher:
        cassandra = CassandraCluster(config.cassandra_cluster(), launcher)
        try:
            # Cassandra first: the orchestrators need it. SIGTERM at shutdown drains each member
            # (flushes memtables) through Cassandra's own shutdown hook.
            cassandra.start()
            for spec in mesh_specs(config, run_dir):
                if stop.is_set():
                    return 130
                launcher.start(spec)
        except (PortInUseError, ServiceFailedError, InvalidEnvoyConfigError, NodeSetupError) as exc:
            print(f"\nERROR: {exc}", file=sys.stderr)
            return 1
        token = ensure_keys().mint(config.user, config.tier)
        contacts = ", ".join(config.cassandra_cluster().contact_points())
        print(
            f"\nchatmesh is up. Logs: {run_dir / 'logs'}\n"
            f"{welcome(config.ports.front_door, token, config.user, config.tier)}\n"
            f"  cassandra:    {contacts} (CQL; data in {config.cassandra_data_dir})\n"
            "A service that dies is restarted. Press Ctrl-C to stop everything.",
            flush=True,
        )
        supervisor = Supervisor(launcher)
        supervisor.watch_all()
        while not stop.wait(1.0):
            supervisor.tick()
        print("\nstopping chatmesh ...", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
