"""``python -m localmesh.mesh`` (``make run``): the whole mesh on 127.0.0.1 under one supervisor.

Starts the services in dependency order, waits for each to be healthy, prints where to connect, then
restarts any service that dies (with backoff, logged: ``meshkit/supervisor.py``) until Ctrl-C stops
everything. Logs go to ``.run/mesh/logs/<service>.log``.

Each tier can run several replicas (``--orchestrators 2 --routers 2 --engines 3 --cassandra-nodes 3``).
Replica i of the orchestrator and router tiers listens (and serves metrics) ``REPLICA_PORT_STRIDE * i``
above the first one's ports; engines take consecutive ports. Every router follows every engine;
orchestrator i uses router i mod R; Envoy spreads chats over the orchestrators (ring hash on the chat
id). Cassandra members listen on 127.0.0.1 ... 127.0.0.N with the keyspace replicated to three of them
(``localmesh/cassandra/cluster.py``).

Three pools of engines, placed by model: SmolLM2-135M-Instruct (chat), its "-lite" twin (the same
weights, where free requests degrade to) and Gemma 3 270M (a base model: completions only, under the
Gemma Terms of Use; ``--completion-engines 0`` leaves it out). The orchestrator prompts each with its
own tokenizer (one ``--model-file`` per pool). A fourth pool embeds: all-MiniLM-L6-v2 on one thread
(``POST /v1/embeddings``; idle, it costs ~210 MB resident and no CPU; ``--embedding-engines 0`` leaves it out).

Every service exposes Prometheus ``/metrics`` on a fixed port (printed at start), and every span lands in
``.run/mesh/spans.jsonl``: the Python services write it themselves (``CHATMESH_TRACE_FILE``), Envoy sends
its spans over OTLP to a small collector that appends them (localmesh/span_collector.py). The edge scrapes
the metrics and reads the spans for the operations page (``/ops``, for an operator token).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from chatmesh.identity import OPERATOR_ROLE
from chatmesh.model_files import bundled_model_path, gemma3_model_path, minilm_model_path
from chatmesh.tokenizer import load_tokenizer
from localmesh.cassandra.cluster import CassandraCluster, ClusterConfig
from localmesh.cassandra.node import NodeSetupError
from localmesh.dev_jwt import ensure_keys
from localmesh.front_door import FrontDoorPorts, front_door_specs, welcome
from meshkit.envoy import InvalidEnvoyConfigError
from meshkit.launcher import GrpcHealthy, Launcher, ServiceFailedError, ServiceSpec, TcpOpen
from meshkit.serving import PortInUseError
from meshkit.supervisor import Supervisor
from meshkit.telemetry import TRACE_FILE_ENV

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
    # Prometheus /metrics of each service (Envoy's: its admin port's /stats/prometheus).
    orchestrator_metrics: int = 9450
    router_metrics: int = 9451
    first_engine_metrics: int = 9461
    edge_metrics: int = 9481
    # OTLP/gRPC: the span collector Envoy exports to.
    otlp: int = 4317


# The cheaper pool a free request is degraded to when the primary pool is past the free tier's
# threshold. Honestly named: the same SmolLM2-135M Q4_1 weights as the primary pool, served under
# another name by an engine with one compute thread, 3/8 of the KV memory (0.1875 GiB of float16 KV:
# still one full 8,192-token context, so every prompt the orchestrator builds fits) and 8 running
# requests at most: it costs a fraction of a primary engine and answers more slowly under load.
LITE_SUFFIX = "-lite"
LITE_ENGINE_FLAGS = ("--threads", "1", "--kv-memory-gib", "0.1875", "--max-running-requests", "8")
# The completion pool: Gemma 3 270M (a base model: /v1/completions only; Gemma Terms of Use), one
# compute thread beside the chat pools on a small box. Its file declares a 32,768-token window; the
# orchestrator fits its prompts to COMPLETION_CONTEXT, whose KV (18 layers x one 256-wide KV head x
# K and V in float16: 18 KiB a token, 0.14 GiB) this KV memory holds.
COMPLETION_CONTEXT = 8192
COMPLETION_ENGINE_FLAGS = ("--threads", "1", "--kv-memory-gib", "0.1875", "--max-running-requests", "8")
# The embedding pool computes on the cpu backend whatever the others run (a null mesh included): its
# forward is a few milliseconds a sentence, and nothing else embeds.
EMBEDDING_ENGINE_FLAGS = ("--threads", "1", "--backend", "cpu")


def replica_name(tier: str, index: int, replicas: int) -> str:
    """``router`` when the tier has one replica, ``router-0``, ``router-1``, ... when it has more."""
    return tier if replicas == 1 else f"{tier}-{index}"


def replica_ports(first: int, replicas: int) -> list[int]:
    return [first + REPLICA_PORT_STRIDE * i for i in range(replicas)]


@dataclass(frozen=True)
class MeshConfig:
    ports: MeshPorts = MeshPorts()
    engines: int = 2
    lite_engines: int = 1  # engines of the cheaper pool (0: the free tier is shed, never degraded)
    completion_engines: int = 0  # engines of Gemma 3 270M, the completion pool (`make run`: 1)
    embedding_engines: int = 0  # engines of all-MiniLM-L6-v2, the embedding pool (`make run`: 1)
    orchestrators: int = 1
    routers: int = 1
    cassandra_nodes: int = 1
    engine_backend: str = "cpu"
    python: str = sys.executable
    # Whom the dev token printed at start-up speaks for.
    user: str = "alice"
    tier: str = "pro"
    cassandra_data_dir: Path = Path(".run/mesh/cassandra")
    # More ``python -m engine`` flags for every engine (the chaos suite paces null engines).
    engine_flags: tuple[str, ...] = ()
    # More ``python -m orchestrator`` flags for every replica (the chaos suite turns its tools on).
    orchestrator_flags: tuple[str, ...] = ()
    # Ports services dial in place of another service's own: a proxy listens there in front of it (the
    # chaos suite injects latency so). Empty: every service dials the others directly.
    dial_overrides: Mapping[int, int] = field(default_factory=dict)

    def dialed(self, port: int) -> int:
        """The port a client of the service listening on ``port`` dials."""
        return self.dial_overrides.get(port, port)

    def engine_ports(self) -> list[int]:
        """The primary engines' ports, then the cheaper pool's, the completion pool's, the embedding pool's."""
        return [self.ports.first_engine + i for i in range(self.all_engines)]

    @property
    def all_engines(self) -> int:
        return self.engines + self.lite_engines + self.completion_engines + self.embedding_engines

    def orchestrator_ports(self) -> list[int]:
        return replica_ports(self.ports.orchestrator, self.orchestrators)

    def router_ports(self) -> list[int]:
        return replica_ports(self.ports.router, self.routers)

    def cassandra_cluster(self) -> ClusterConfig:
        """The mesh's Cassandra: started first, before everything else; its data survives restarts."""
        return ClusterConfig(
            data_dir=self.cassandra_data_dir.resolve(),
            size=self.cassandra_nodes,
            cql_port=self.ports.cassandra,
            storage_port=self.ports.cassandra_storage,
            first_jmx_port=self.ports.cassandra_jmx,
        )

    def metrics_endpoints(self) -> dict[str, str]:
        """Every service's Prometheus endpoint by service name (an engine's name is its engine id)."""
        ports = self.ports
        endpoints = {
            f"engine-{i}": f"http://127.0.0.1:{ports.first_engine_metrics + i}/metrics"
            for i in range(self.all_engines)
        }
        for tier, first, replicas in (
            ("router", ports.router_metrics, self.routers),
            ("orchestrator", ports.orchestrator_metrics, self.orchestrators),
        ):
            for i, port in enumerate(replica_ports(first, replicas)):
                endpoints[replica_name(tier, i, replicas)] = f"http://127.0.0.1:{port}/metrics"
        endpoints["edge"] = f"http://127.0.0.1:{ports.edge_metrics}/metrics"
        return endpoints

    def ops_targets(self) -> list[str]:
        """The edge's --ops-metrics-target flags: every service but the edge itself."""
        return [
            flag
            for name, url in self.metrics_endpoints().items()
            if name != "edge"
            for flag in ("--ops-metrics-target", f"{name}={url}")
        ]


def mesh_specs(config: MeshConfig, run_dir: Path) -> list[ServiceSpec]:
    """The services of the local mesh, in start order."""
    py, ports = config.python, config.ports
    # One key pair: Envoy, the edge and the orchestrator each verify the tokens it signs.
    keys = ensure_keys()
    model = load_tokenizer().model_name  # the bundled weights' name: the primary pool's model
    lite_model = model + LITE_SUFFIX
    completion_model = gemma3_model_path() if config.completion_engines else None
    spans = span_file(run_dir)
    collector = ServiceSpec(
        name="span-collector",
        argv=[py, "-m", "localmesh.span_collector", "--port", str(ports.otlp), "--file", str(spans)],
        ports=(ports.otlp,),
        ready=TcpOpen(ports.otlp),
    )
    specs = [collector]
    for i, port in enumerate(config.engine_ports()):
        pool_flags: tuple[str, ...] = ()
        embedding = i >= config.engines + config.lite_engines + config.completion_engines
        if embedding:
            pool_flags = ("--model", str(minilm_model_path()))
        elif i >= config.engines + config.lite_engines:
            pool_flags = ("--model", str(completion_model), *COMPLETION_ENGINE_FLAGS)
        elif i >= config.engines:
            pool_flags = ("--served-model-name", lite_model, *LITE_ENGINE_FLAGS)
        metrics_port = ports.first_engine_metrics + i
        argv = [py, "-m", "engine", "--port", str(port), "--engine-id", f"engine-{i}", *pool_flags]
        specs.append(
            ServiceSpec(
                name=f"engine-{i}",
                argv=[
                    *argv,
                    "--backend",
                    config.engine_backend,
                    "--metrics-port",
                    str(metrics_port),
                    *config.engine_flags,
                    *(EMBEDDING_ENGINE_FLAGS if embedding else ()),
                ],
                ports=(port, metrics_port),
                ready=GrpcHealthy(port),
                ready_timeout_s=180,
            )
        )
    # Named like the engines' --engine-id, so `routed` frames, logs and metrics agree on engine names.
    # Every router follows every engine (their KV events included).
    engine_flags = [
        flag
        for i, port in enumerate(config.engine_ports())
        for flag in ("--engine", f"engine-{i}=127.0.0.1:{config.dialed(port)}")
    ]
    degrade_flags = ("--degrade", f"{model}={lite_model}") if config.lite_engines else ()
    router_ports = config.router_ports()
    router_metrics = replica_ports(ports.router_metrics, config.routers)
    specs.extend(
        ServiceSpec(
            name=replica_name("router", i, config.routers),
            argv=[
                py,
                "-m",
                "router",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics),
                *engine_flags,
                *degrade_flags,
            ],
            ports=(port, metrics),
            ready=GrpcHealthy(port),
        )
        for i, (port, metrics) in enumerate(zip(router_ports, router_metrics, strict=True))
    )
    cassandra = config.cassandra_cluster()
    cassandra_flags = [
        *(flag for contact in cassandra.contact_points() for flag in ("--cassandra", contact)),
        *("--cassandra-replication", cassandra.replication_flag()),
    ]
    orchestrator_metrics = replica_ports(ports.orchestrator_metrics, config.orchestrators)
    # Every pool's model, each prompted with its own tokenizer: the lite pool under its own name.
    model_flags = ["--model-file", str(bundled_model_path())]
    if config.lite_engines:
        model_flags += ["--model-file", f"{lite_model}={bundled_model_path()}"]
    if completion_model is not None:
        model_flags += ["--model-file", str(completion_model), "--context-window", str(COMPLETION_CONTEXT)]
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
                # Every router: generations spread round-robin and go on through another when one dies.
                ",".join(f"127.0.0.1:{config.dialed(router)}" for router in router_ports),
                *cassandra_flags,
                "--metrics-port",
                str(metrics),
                *keys.service_flags(),
                *model_flags,
                *config.orchestrator_flags,
            ],
            ports=(port, metrics),
            ready=GrpcHealthy(port),
        )
        for i, (port, metrics) in enumerate(
            zip(config.orchestrator_ports(), orchestrator_metrics, strict=True)
        )
    )
    # The front door: the edge, then Envoy in front of it and the orchestrator.
    # The edge serves the operations page from every other service's metrics and the span file.
    edge_flags = [
        "--metrics-port",
        str(ports.edge_metrics),
        *config.ops_targets(),
        "--ops-trace-file",
        str(spans),
    ]
    specs.extend(
        front_door_specs(
            ports.front_door,
            [config.dialed(port) for port in config.orchestrator_ports()],
            run_dir,
            keys,
            py,
            edge_flags=edge_flags,
            otlp=("127.0.0.1", ports.otlp),
            edge_dialed=config.dialed(ports.front_door.edge),
        )
    )
    return specs


def span_file(run_dir: Path) -> Path:
    return (run_dir / "spans.jsonl").resolve()


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
    parser.add_argument("--user", default="alice", help="who the printed token is for")
    parser.add_argument("--tier", default="pro", help="the printed token's tier")
    parser.add_argument("--cassandra-port", type=int, default=defaults.cassandra, help="CQL port")
    parser.add_argument("--cassandra-storage-port", type=int, default=defaults.cassandra_storage)
    parser.add_argument("--cassandra-jmx-port", type=int, default=defaults.cassandra_jmx)
    parser.add_argument("--orchestrator-metrics-port", type=int, default=defaults.orchestrator_metrics)
    parser.add_argument("--router-metrics-port", type=int, default=defaults.router_metrics)
    parser.add_argument("--first-engine-metrics-port", type=int, default=defaults.first_engine_metrics)
    parser.add_argument("--edge-metrics-port", type=int, default=defaults.edge_metrics)
    parser.add_argument("--otlp-port", type=int, default=defaults.otlp, help="the span collector (OTLP/gRPC)")
    parser.add_argument("--engines", type=int, default=2, help="number of engine replicas")
    parser.add_argument(
        "--lite-engines", type=int, default=1, help="engines of the cheaper pool free requests degrade to"
    )
    parser.add_argument(
        "--completion-engines",
        type=int,
        default=1,
        help="engines of Gemma 3 270M, the completion pool (Gemma Terms of Use; 0: none)",
    )
    parser.add_argument(
        "--embedding-engines",
        type=int,
        default=1,
        help="engines of all-MiniLM-L6-v2, the embedding pool of /v1/embeddings (0: none)",
    )
    parser.add_argument("--orchestrators", type=int, default=1, help="number of orchestrator replicas")
    parser.add_argument("--routers", type=int, default=1, help="number of router replicas")
    parser.add_argument(
        "--cassandra-nodes", type=int, default=1, help="Cassandra cluster size (127.0.0.1 ... 127.0.0.N)"
    )
    parser.add_argument("--engine-backend", default="cpu", help="cpu (real model) or null (no compute)")
    parser.add_argument("--run-dir", type=Path, default=Path(".run/mesh"))
    args = parser.parse_args(argv)
    door = FrontDoorPorts(args.envoy_port, args.envoy_admin_port, args.edge_port)
    ports = MeshPorts(
        args.orchestrator_port,
        args.router_port,
        args.first_engine_port,
        door,
        cassandra=args.cassandra_port,
        cassandra_storage=args.cassandra_storage_port,
        cassandra_jmx=args.cassandra_jmx_port,
        orchestrator_metrics=args.orchestrator_metrics_port,
        router_metrics=args.router_metrics_port,
        first_engine_metrics=args.first_engine_metrics_port,
        edge_metrics=args.edge_metrics_port,
        otlp=args.otlp_port,
    )
    config = MeshConfig(
        ports=ports,
        engines=args.engines,
        lite_engines=args.lite_engines,
        completion_engines=args.completion_engines,
        embedding_engines=args.embedding_engines,
        orchestrators=args.orchestrators,
        routers=args.routers,
        cassandra_nodes=args.cassandra_nodes,
        engine_backend=args.engine_backend,
        user=args.user,
        tier=args.tier,
        cassandra_data_dir=args.run_dir / "cassandra",
    )
    return config, args.run_dir


def observability(config: MeshConfig, run_dir: Path, operator_token: str) -> str:
    """Where to see the mesh: the operations page, every /metrics endpoint, the span file."""
    ports = config.ports
    lines = [
        "  Operations page (operator token; make token ROLE=operator prints another):",
        f"  http://127.0.0.1:{ports.front_door.envoy}/ops#token={operator_token}",
        "  Prometheus metrics:",
        *(f"  {name + ':':16}{url}" for name, url in config.metrics_endpoints().items()),
        f"  {'envoy:':16}http://127.0.0.1:{ports.front_door.envoy_admin}/stats/prometheus",
        f"  Traces: {span_file(run_dir)} (JSON lines; Envoy's via OTLP on 127.0.0.1:{ports.otlp})",
    ]
    return "\n".join(lines)


# What ``start`` raises when the mesh cannot start (each says why).
START_ERRORS = (PortInUseError, ServiceFailedError, InvalidEnvoyConfigError, NodeSetupError)


def start(
    config: MeshConfig, run_dir: Path, launcher: Launcher, stopping: Callable[[], bool] = lambda: False
) -> CassandraCluster | None:
    """Starts Cassandra, then every service in order, each once it is ready; None if ``stopping()``
    turned true first. Raises one of ``START_ERRORS`` if a service cannot start."""
    cassandra = CassandraCluster(config.cassandra_cluster(), launcher)
    # Cassandra first: the orchestrators need it. SIGTERM at shutdown drains each member
    # (flushes memtables) through Cassandra's own shutdown hook.
    cassandra.start()
    for spec in mesh_specs(config, run_dir):
        if stopping():
            return None
        launcher.start(spec)
    return cassandra


def main(argv: list[str] | None = None) -> int:
    config, run_dir = parse_args(argv)
    if config.completion_engines:
        try:  # before anything starts: the completion pool's weights are assembled by `make setup`
            gemma3_model_path()
        except FileNotFoundError as exc:
            print(f"ERROR: {exc}; or serve no completion pool: --completion-engines 0", file=sys.stderr)
            return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # Every service this starts writes its spans to the one span file, fresh for each run.
    span_file(run_dir).parent.mkdir(parents=True, exist_ok=True)
    span_file(run_dir).unlink(missing_ok=True)
    os.environ[TRACE_FILE_ENV] = str(span_file(run_dir))
    with Launcher(run_dir) as launcher:
        try:
            if start(config, run_dir, launcher, stop.is_set) is None:
                return 130
        except START_ERRORS as exc:
            print(f"\nERROR: {exc}", file=sys.stderr)
            return 1
        keys = ensure_keys()
        token = keys.mint(config.user, config.tier)
        operator = keys.mint("operator", config.tier, role=OPERATOR_ROLE)
        contacts = ", ".join(config.cassandra_cluster().contact_points())
        print(
            f"\nchatmesh is up. Logs: {run_dir / 'logs'}\n"
            f"{welcome(config.ports.front_door, token, config.user, config.tier)}\n"
            f"  cassandra:    {contacts} (CQL; data in {config.cassandra_data_dir})\n"
            f"{observability(config, run_dir, operator)}\n"
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
