"""The local Apache Cassandra node: configuration, start, readiness, drain, stop, crash.

Cassandra runs from the jars that ``scripts/provision.sh`` fetched from Maven Central into
``.cache/cassandra/lib`` (pinned by ``localmesh/cassandra/pom.xml``), as a plain
``org.apache.cassandra.service.CassandraDaemon`` on Java 17 with the flags of Cassandra's own
``conf/jvm17-server.options``. Each node gets its own data dir holding its ``conf/cassandra.yaml``,
data, commitlog and hints, so a test node and a ``make run`` node never share anything.

The node is durable: ``commitlog_sync: batch`` acknowledges a write only after the commitlog is fsynced,
so a write that Cassandra acknowledged survives ``kill -9`` (tests prove it). Stopping drains first
(``nodetool drain`` flushes memtables, so the next start replays nothing), then sends SIGTERM.

Used by ``python -m localmesh.cassandra ...``, ``localmesh/mesh.py`` (``make run``) and the test fixture
``tests/fixtures/cassandra.py``.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from meshkit.launcher import Launcher, ServiceSpec

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LIB_DIR = PROJECT_ROOT / ".cache" / "cassandra" / "lib"
LOGBACK_XML = Path(__file__).resolve().parent / "logback.xml"
MAIN_CLASS = "org.apache.cassandra.service.CassandraDaemon"
NODETOOL_CLASS = "org.apache.cassandra.tools.NodeTool"

# Module access Cassandra needs on Java 17 (conf/jvm17-server.options, "JPMS").
JPMS_FLAGS = (
    "-Djdk.attach.allowAttachSelf=true",
    *(
        f"--add-exports={module}=ALL-UNNAMED"
        for module in (
            "java.base/jdk.internal.misc",
            "java.management.rmi/com.sun.jmx.remote.internal.rmi",
            "java.rmi/sun.rmi.registry",
            "java.rmi/sun.rmi.server",
            "java.sql/java.sql",
            "java.base/java.lang.ref",
            "jdk.unsupported/sun.misc",
            "jdk.compiler/com.sun.tools.javac.file",
            "jdk.attach/sun.tools.attach",
        )
    ),
    *(
        f"--add-opens={module}=ALL-UNNAMED"
        for module in (
            "java.base/java.lang.module",
            "java.base/jdk.internal.loader",
            "java.base/jdk.internal.ref",
            "java.base/jdk.internal.reflect",
            "java.base/jdk.internal.math",
            "java.base/jdk.internal.module",
            "java.base/jdk.internal.util.jar",
            "jdk.management/com.sun.management.internal",
            "java.base/sun.nio.ch",
            "java.base/java.io",
            "java.base/java.lang.reflect",
            "jdk.compiler/com.sun.tools.javac",
            "java.base/java.lang",
            "java.base/java.util",
        )
    ),
)

# GC and general flags of conf/jvm17-server.options and conf/jvm-server.options. Left out on purpose:
# -XX:+AlwaysPreTouch (it would fault in the whole heap at start), -XX:+UseNUMA, heap dumps.
SERVER_FLAGS = (
    "-ea",
    "-da:net.openhft...",
    "-XX:+UseThreadPriorities",
    "-Xss256k",
    "-XX:+UseTLAB",
    "-XX:+ResizeTLAB",
    "-XX:+PerfDisableSharedMem",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.net.preferIPv4Stack=true",
    "-XX:+UseG1GC",
    "-XX:+ParallelRefProcEnabled",
    "-XX:MaxTenuringThreshold=1",
    "-XX:G1HeapRegionSize=16m",
    "-XX:G1RSetUpdatingPauseTimePercent=5",
    "-XX:MaxGCPauseMillis=300",
    "-XX:InitiatingHeapOccupancyPercent=70",
    "-Dio.netty.tryReflectionSetAccessible=true",
    "-Dio.netty.allocator.useCacheForAllThreads=true",
    "-Dio.netty.allocator.maxOrder=11",
)

# Local nodes start with their tokens given (no bootstrap): do not wait for gossip to settle first.
START_FLAGS = (
    "-Dcassandra.skip_wait_for_gossip_to_settle=0",
    "-Dchronicle.announcer.disable=true",
)
# A node alone has no peers to tell about its shutdown: skip the pause that lets the news spread.
ALONE_FLAGS = ("-Dcassandra.shutdown_announce_in_ms=0",)


class NodeSetupError(RuntimeError):
    """Java or the Cassandra jars are missing; the message says how to fix it."""


@dataclass(frozen=True)
class NodeConfig:
    """One local node. Alone by default (127.0.0.1, its own seed); ``localmesh/cassandra/cluster.py`` gives
    each member of a local cluster its own loopback address, token, seeds and (across data centres) its
    data centre."""

    data_dir: Path
    cql_port: int = 9042
    storage_port: int = 7000
    jmx_port: int = 7199
    heap_min: str = "256m"
    heap_max: str = "1g"
    lib_dir: Path = DEFAULT_LIB_DIR
    java: str = "java"
    # The stock launcher loads jamm as a javaagent so memtables are sized by instrumentation; without
    # it Cassandra 5.0 falls back to estimating sizes. Start time and RSS measured the same either way.
    jamm_agent: bool = True
    ready_timeout_s: float = 180.0
    # Where the node listens (storage and CQL); every member of a local cluster has its own address.
    address: str = "127.0.0.1"
    # The seeds' addresses (same storage port); a node alone is its own seed, a cluster of several data
    # centres names one seed in each so either side can start (or restart) while the other is away.
    seeds: tuple[str, ...] = ("127.0.0.1",)
    # num_tokens is 1, so a cluster's members split the ring by giving each its own token.
    initial_token: int = 0
    # How many nodes the cluster has (1: this one alone).
    cluster_size: int = 1
    # The node's data centre and rack, told to GossipingPropertyFileSnitch through
    # conf/cassandra-rackdc.properties; None: SimpleSnitch, every node in "datacenter1".
    datacenter: str | None = None
    rack: str = "rack1"
    # What a secured cluster asks of clients, to test memory_store against (a dev node needs neither):
    # PasswordAuthenticator (the default superuser is cassandra/cassandra), and CQL over TLS only, the
    # node's key and certificate chain in one PEM file.
    password_auth: bool = False
    tls_keystore_pem: Path | None = None

    @property
    def conf_dir(self) -> Path:
        return self.data_dir / "conf"

    @property
    def yaml_path(self) -> Path:
        return self.conf_dir / "cassandra.yaml"

    @property
    def rackdc_path(self) -> Path:
        # GossipingPropertyFileSnitch loads it from the classpath, whose first entry is conf_dir.
        return self.conf_dir / "cassandra-rackdc.properties"

    @property
    def snitch(self) -> str:
        return "SimpleSnitch" if self.datacenter is None else "GossipingPropertyFileSnitch"

    def classpath(self) -> str:
        return f"{self.conf_dir}:{self.lib_dir}/*"

    def jamm_jar(self) -> Path | None:
        return next(iter(sorted(self.lib_dir.glob("jamm-*.jar"))), None)


def cassandra_yaml(config: NodeConfig) -> str:
    """The node's cassandra.yaml (5.0 key names and units); everything else keeps its default."""
    data = config.data_dir
    return f"""\
# Written by localmesh/cassandra/node.py for a local node; regenerated at every start.
cluster_name: chatmesh
num_tokens: 1
initial_token: {config.initial_token}
# Members of a new local cluster start empty, with their tokens given: nothing to stream at first
# start. A member that was down catches up from hints (and repair), not by bootstrapping again.
auto_bootstrap: false
partitioner: org.apache.cassandra.dht.Murmur3Partitioner
endpoint_snitch: {config.snitch}
listen_address: {config.address}
rpc_address: {config.address}
storage_port: {config.storage_port}
native_transport_port: {config.cql_port}
start_native_transport: true
seed_provider:
  - class_name: org.apache.cassandra.locator.SimpleSeedProvider
    parameters:
      - seeds: "{",".join(f"{seed}:{config.storage_port}" for seed in config.seeds)}"
data_file_directories:
  - {data}/data
commitlog_directory: {data}/commitlog
hints_directory: {data}/hints
saved_caches_directory: {data}/saved_caches
cdc_raw_directory: {data}/cdc_raw
# Durability: acknowledge a write only after its commitlog entry is fsynced (periodic, the default,
# may lose up to 10 s of acknowledged writes on a crash). Concurrent writes share one fsync.
commitlog_sync: batch
# Hints for a member that was down reach disk within a second (default 10 s), so it catches up soon
# after it comes back.
hints_flush_period: 1000ms
commitlog_segment_size: 32MiB
commitlog_total_space: 512MiB
# A small footprint for a laptop or CI box.
memtable_heap_space: 128MiB
memtable_offheap_space: 128MiB
file_cache_size: 64MiB
key_cache_size: 16MiB
concurrent_compactors: 1
# A send stores its question and its run in one logged batch across partitions, up to the store's
# --cassandra-max-batch-bytes (40 KiB): no warning below the fail threshold (50 KiB, the default).
batch_size_warn_threshold: 48KiB
# Running answers' checkpoints go as unlogged batches of up to 64 runs whose partitions the same nodes
# hold (memory_store's checkpoint_runs): no warning for those.
unlogged_batch_across_partitions_warn_threshold: 64
# A new cluster: no 4.x nodes to stay compatible with; Paxos v2 (fewer round trips per LWT).
storage_compatibility_mode: NONE
paxos_variant: v2
auto_snapshot: false
{_client_security(config)}"""


def _client_security(config: NodeConfig) -> str:
    lines = []
    if config.password_auth:
        lines.append("authenticator: PasswordAuthenticator")
    if config.tls_keystore_pem is not None:
        lines += [
            "client_encryption_options:",
            "  enabled: true",
            "  optional: false",
            "  ssl_context_factory:",
            "    class_name: org.apache.cassandra.security.PEMBasedSslContextFactory",
            f"  keystore: {config.tls_keystore_pem}",
        ]
    return "".join(f"{line}\n" for line in lines)


def jvm_argv(config: NodeConfig) -> list[str]:
    """The java command line of the node."""
    agent = config.jamm_jar() if config.jamm_agent else None
    return [
        config.java,
        f"-Xms{config.heap_min}",
        f"-Xmx{config.heap_max}",
        *SERVER_FLAGS,
        *JPMS_FLAGS,
        *START_FLAGS,
        *(ALONE_FLAGS if config.cluster_size == 1 else ()),
        # The default superuser at once, not after the 10 s meant for a cluster's nodes to agree.
        *(["-Dcassandra.superuser_setup_delay_ms=0"] if config.password_auth else []),
        *([f"-javaagent:{agent}"] if agent else []),
        f"-Dcassandra.config=file://{config.yaml_path}",
        f"-Dcassandra.storagedir={config.data_dir}",
        f"-Dcassandra.logdir={config.data_dir / 'logs'}",
        f"-Dlogback.configurationFile={LOGBACK_XML}",
        f"-Dcassandra.jmx.local.port={config.jmx_port}",
        "-Dcassandra-foreground=yes",
        "-cp",
        config.classpath(),
        MAIN_CLASS,
    ]


def check_prerequisites(config: NodeConfig) -> None:
    """Raises NodeSetupError with what to do when Java or the jars are missing."""
    if shutil.which(config.java) is None:
        raise NodeSetupError(
            "Java 17 is needed to run Cassandra but `java` is not on PATH. "
            "Install it (Debian: apt-get install openjdk-17-jre-headless), then run `make setup`."
        )
    if not any(config.lib_dir.glob("cassandra-all-*.jar")):
        raise NodeSetupError(
            f"Cassandra's jars are not in {config.lib_dir}. Run `make setup` (scripts/provision.sh "
            "fetches them with Maven; install Maven first if it is missing: apt-get install maven)."
        )


def rackdc_properties(config: NodeConfig) -> str:
    """The node's cassandra-rackdc.properties: where GossipingPropertyFileSnitch places it."""
    return (
        "# Written by localmesh/cassandra/node.py for a local node; regenerated at every start.\n"
        f"dc={config.datacenter}\nrack={config.rack}\n"
    )


def write_conf(config: NodeConfig) -> None:
    config.conf_dir.mkdir(parents=True, exist_ok=True)
    (config.data_dir / "logs").mkdir(exist_ok=True)
    config.yaml_path.write_text(cassandra_yaml(config))
    if config.datacenter is not None:
        config.rackdc_path.write_text(rackdc_properties(config))


@dataclass(frozen=True)
class CqlAnswers:
    """Ready when the native transport answers a CQL OPTIONS request with SUPPORTED.

    An open port is not enough: Cassandra opens it last, but a CQL answer is what clients need.
    """

    port: int
    host: str = "127.0.0.1"
    # Speak TLS (a node whose clients must); the probe only asks whether CQL answers, so it trusts any
    # certificate. OPTIONS needs no login, so PasswordAuthenticator does not matter here.
    tls: bool = False

    # Protocol v4 frame header: version, flags, stream id, opcode, body length.
    _OPTIONS = struct.pack(">BBhBi", 0x04, 0, 1, 0x05, 0)
    _SUPPORTED = 0x06

    def __call__(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as plain:
                sock = _probe_tls().wrap_socket(plain) if self.tls else plain
                sock.sendall(self._OPTIONS)
                header = sock.recv(9)
        except OSError:
            return False
        return len(header) >= 5 and header[0] == 0x84 and header[4] == self._SUPPORTED

    def describe(self) -> str:
        return f"CQL{' over TLS' if self.tls else ''} on {self.host}:{self.port}"


def _probe_tls() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def service_spec(config: NodeConfig, name: str = "cassandra") -> ServiceSpec:
    """How the launcher starts the node (writes its conf first). SIGTERM drains it (shutdown hook)."""
    check_prerequisites(config)
    write_conf(config)
    return ServiceSpec(
        name=name,
        argv=jvm_argv(config),
        # JMX listens on 127.0.0.1 whatever the node's address (-Dcassandra.jmx.local.port).
        ports=(config.jmx_port,),
        addresses=((config.address, config.cql_port), (config.address, config.storage_port)),
        ready=CqlAnswers(config.cql_port, config.address, tls=config.tls_keystore_pem is not None),
        ready_timeout_s=config.ready_timeout_s,
        stop_timeout_s=90.0,
    )


def rss_mib(pid: int) -> float | None:
    """Resident set size of a process in MiB (Linux), or None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class StartReport:
    startup_s: float
    rss_mib: float | None
    pid: int


# A line of describecluster's "Schema versions:" block: "<version>: [<address>, <address>]".
_SCHEMA_VERSION = re.compile(r"^\s*([0-9a-fA-F-]{36}|UNREACHABLE): \[([^\]]*)\]", re.MULTILINE)


def parse_schema_versions(describecluster: str) -> dict[str, list[str]]:
    """The "Schema versions:" block of ``nodetool describecluster``: each version with the addresses
    holding it (unreachable members are listed under ``UNREACHABLE``)."""
    _, _, listing = describecluster.partition("Schema versions:")
    return {
        match[1]: [address.strip() for address in match[2].split(",") if address.strip()]
        for match in _SCHEMA_VERSION.finditer(listing.split("\n\n", 1)[0])
    }


class CassandraNode:
    """A local node supervised by a ``Launcher``: start, drain, stop, and crash (for tests)."""

    def __init__(self, config: NodeConfig, launcher: Launcher, name: str = "cassandra") -> None:
        self.config = config
        self.launcher = launcher
        self.name = name
        self._spawned_at = time.monotonic()

    @property
    def contact(self) -> tuple[str, int]:
        return (self.config.address, self.config.cql_port)

    @property
    def pid(self) -> int | None:
        running = self.launcher.running.get(self.name)
        return running.pid if running else None

    def start(self) -> StartReport:
        """Starts the node and blocks until CQL answers; prints startup time and RSS."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Starts the node without waiting (``wait_ready`` waits): a cluster's members start side by side."""
        self._spawned_at = time.monotonic()
        self.launcher.spawn(service_spec(self.config, self.name))

    def wait_ready(self) -> StartReport:
        """Blocks until the spawned node answers CQL; prints startup time and RSS."""
        running = self.launcher.wait_ready(self.name)
        report = StartReport(time.monotonic() - self._spawned_at, rss_mib(running.pid), running.pid)
        rss = f"{report.rss_mib:.0f} MiB" if report.rss_mib is not None else "unknown"
        print(
            f"  {self.name}: Cassandra up in {report.startup_s:.1f}s, RSS {rss}, "
            f"CQL {self.config.address}:{self.config.cql_port}, data {self.config.data_dir}",
            flush=True,
        )
        return report

    def nodetool(self, *args: str, timeout_s: float = 120.0) -> str:
        """Runs nodetool (from the same jars) against this node's local JMX port."""
        argv = [
            self.config.java,
            "-Xmx128m",
            *JPMS_FLAGS,
            f"-Dcassandra.logdir={self.config.data_dir / 'logs'}",
            f"-Dlogback.configurationFile={LOGBACK_XML}",
            # nodetool keeps a history file under ~/.cassandra: keep it with the node's data instead.
            f"-Duser.home={self.config.data_dir}",
            "-cp",
            self.config.classpath(),
            NODETOOL_CLASS,
            "-h",
            "127.0.0.1",
            "-p",
            str(self.config.jmx_port),
            *args,
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"nodetool {' '.join(args)} failed: {done.stdout}{done.stderr}".strip())
        return done.stdout

    def schema_versions(self) -> dict[str, list[str]]:
        """The schema versions this node's gossip reports, each with the addresses holding it."""
        return parse_schema_versions(self.nodetool("describecluster"))

    def drain(self) -> None:
        """Flushes memtables and stops accepting writes (the node must still be stopped after)."""
        self.nodetool("drain")

    def stop(self) -> int | None:
        """Drain, then SIGTERM. Returns the exit code (None if it was not running)."""
        if self.pid is None:
            return None
        started = time.monotonic()
        try:
            self.drain()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            # SIGTERM still drains through Cassandra's shutdown hook; say why the explicit drain failed.
            print(f"  {self.name}: drain failed ({exc}); stopping with SIGTERM", flush=True)
        code = self.launcher.stop(self.name)
        print(f"  {self.name}: drained and stopped in {time.monotonic() - started:.1f}s", flush=True)
        return code

    def kill(self) -> None:
        """SIGKILL the node, as a crash would (tests restart it with ``start()`` on the same data)."""
        self.launcher.signal(self.name, signal.SIGKILL)
        with contextlib.suppress(KeyError):
            self.launcher.forget(self.name)
