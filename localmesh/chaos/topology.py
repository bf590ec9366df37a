"""The mesh the chaos suite breaks: ``make run``'s own services (``localmesh.mesh``), on free ports, under
``make run``'s supervisor, with paced null engines.

Engines run the null backend (no model: deterministic text at ``tokens_per_s`` per stream), so a 2-core
box carries the load and the faults; every other service is the real one. With ``tools`` the
orchestrators run their own tools and the engines' text is a calculator call (tool_load.py), so the
load's tool questions take tool steps. The cheaper pool is left out
(the load's users are of the enterprise tier, which never degrades). With ``delay_proxies`` a
``DelayProxy`` sits in front of the first replica of each gRPC or HTTP tier (engine-0, router-0,
orchestrator-0, the edge: their clients dial it) and one in front of Envoy's public port (the users
dial it): the places the ``slow`` fault adds latency.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from localmesh.cassandra.cluster import CassandraCluster, ClusterConfig
from localmesh.chaos.delay_proxy import DelayProxies, DelayProxy
from localmesh.chaos.tool_load import null_text
from localmesh.dev_jwt import DevKeys, ensure_keys
from localmesh.front_door import FrontDoorPorts
from localmesh.mesh import REPLICA_PORT_STRIDE, MeshConfig, MeshPorts, replica_name, start
from meshkit.launcher import (
    Launcher,
    free_consecutive_ports,
    free_port,
    free_port_on_every,
)
from meshkit.supervisor import Supervisor

COMPONENTS = ("engine", "router", "orchestrator", "edge", "envoy", "cassandra")
# Where a delay proxy can stand: the Cassandra driver dials the addresses the members advertise, so no
# proxy can sit in front of one member.
SLOWABLE = ("engine", "router", "orchestrator", "edge", "envoy")


@dataclass(frozen=True)
class Topology:
    orchestrators: int = 2
    routers: int = 2
    engines: int = 3
    cassandra_nodes: int = 3
    tokens_per_s: float = 25.0  # each null engine's pace per stream
    delay_proxies: bool = True
    # The orchestrators run their own tools and the null engines' text is a calculator call
    # (tool_load.py): the load's tool share makes tool steps.
    tools: bool = True
    tool_max_steps: int = 2


def free_mesh_ports(topology: Topology) -> MeshPorts:
    """A free port for everything the mesh listens on (replicas of a tier ``REPLICA_PORT_STRIDE`` apart;
    Cassandra's CQL and storage ports free on every member's address)."""
    addresses = ClusterConfig(Path("."), size=topology.cassandra_nodes).addresses()
    engines = topology.engines
    return MeshPorts(
        orchestrator=free_consecutive_ports(topology.orchestrators, REPLICA_PORT_STRIDE),
        router=free_consecutive_ports(topology.routers, REPLICA_PORT_STRIDE),
        first_engine=free_consecutive_ports(engines),
        front_door=FrontDoorPorts(free_port(), free_port(), free_port()),
        cassandra=free_port_on_every(addresses),
        cassandra_storage=free_port_on_every(addresses),
        cassandra_jmx=free_consecutive_ports(topology.cassandra_nodes),
        orchestrator_metrics=free_consecutive_ports(topology.orchestrators, REPLICA_PORT_STRIDE),
        router_metrics=free_consecutive_ports(topology.routers, REPLICA_PORT_STRIDE),
        first_engine_metrics=free_consecutive_ports(engines),
        edge_metrics=free_port(),
        otlp=free_port(),
    )


class ChaosMesh:
    """The running mesh: which processes each component has, their signals, their recovery."""

    def __init__(self, topology: Topology, run_dir: Path) -> None:
        self.topology = topology
        ports = free_mesh_ports(topology)
        self._public_port = ports.front_door.envoy
        # The first replica of each tier behind a proxy: its clients dial the proxy's port.
        fronted = {
            "engine": ports.first_engine,
            "router": ports.router,
            "orchestrator": ports.orchestrator,
            "edge": ports.front_door.edge,
            "envoy": ports.front_door.envoy,
        }
        proxies = (
            [DelayProxy(name, free_port(), port) for name, port in fronted.items()]
            if topology.delay_proxies
            else []
        )
        self.config = MeshConfig(
            ports=ports,
            engines=topology.engines,
            lite_engines=0,
            orchestrators=topology.orchestrators,
            routers=topology.routers,
            cassandra_nodes=topology.cassandra_nodes,
            engine_backend="null",
            engine_flags=(
                "--null-tokens-per-s",
                f"{topology.tokens_per_s:g}",
                *(("--null-text", null_text()) if topology.tools else ()),
            ),
            orchestrator_flags=(
                ("--tools", "true", "--tool-max-steps", str(topology.tool_max_steps))
                if topology.tools
                else ()
            ),
            cassandra_data_dir=run_dir / "cassandra",
            dial_overrides={proxy.upstream: proxy.port for proxy in proxies},
        )
        self.run_dir = run_dir
        # What make run prints (starts, exits, restarts) goes to a log: the suite prints its own table.
        self.log_path = run_dir / "mesh.log"
        self.launcher = Launcher(run_dir, echo=self._log)
        self.supervisor = Supervisor(self.launcher, echo=self._log)
        self.proxies = DelayProxies(proxies)
        self.keys: DevKeys = ensure_keys()
        self.cassandra: CassandraCluster | None = None

    def _log(self, line: str) -> None:
        with self.log_path.open("a") as log:
            print(f"{time.strftime('%H:%M:%S')} {line.strip()}", file=log)

    def start(self) -> float:
        """Starts every service (Cassandra first) and supervises them; returns the seconds it took."""
        began = time.monotonic()
        self.cassandra = start(self.config, self.run_dir, self.launcher)
        self.supervisor.watch_all()
        return time.monotonic() - began

    def close(self) -> None:
        self.launcher.stop_all()
        self.proxies.close()

    @property
    def url(self) -> str:
        """Where the users connect: Envoy's public port (through its delay proxy when there is one)."""
        return f"http://127.0.0.1:{self.config.dialed(self._public_port)}"

    def replicas(self, component: str) -> list[str]:
        """The launcher's names of the component's processes (the one behind a proxy first)."""
        counts = {"engine": self.topology.engines, "router": self.topology.routers}
        counts["orchestrator"] = self.topology.orchestrators
        if component in counts:
            if component == "engine":
                return [f"engine-{i}" for i in range(counts[component])]
            return [replica_name(component, i, counts[component]) for i in range(counts[component])]
        if component == "cassandra":
            assert self.cassandra is not None
            return [node.name for node in self.cassandra.nodes]
        return [component]

    def logs(self, component: str) -> list[Path]:
        """The log files of the component's processes (each restart appends to its replica's)."""
        return [self.launcher.log_dir / f"{name}.log" for name in self.replicas(component)]

    def pid(self, name: str) -> int | None:
        running = self.launcher.running.get(name)
        return running.pid if running else None

    def ready(self, name: str) -> bool:
        """Whether the process ``name`` runs and passes its readiness check."""
        running = self.launcher.running.get(name)
        if running is None or running.process.poll() is not None:
            return False
        return running.spec.ready is None or running.spec.ready()

    def signal(self, name: str, sig: int) -> None:
        self.launcher.signal(name, sig)
