"""A local Cassandra cluster: N nodes on the loopback addresses 127.0.0.1 … 127.0.0.N.

Every member listens on its own address with the same CQL and storage ports (the driver takes one port
for all contact points), keeps its own data dir and its own JMX port on 127.0.0.1 (for nodetool). The
members split the Murmur3 ring evenly with one given token each and start without bootstrapping (the
cluster is new), the first member being the seed. The keyspace replicates to three of them (all of
them in a smaller cluster), so at LOCAL_QUORUM one member may die with no client error and no
acknowledged write lost; it catches up from the hints the others kept for it when it comes back.

A cluster of one is the single local node ``make run`` and the tests have always used.

Given ``datacenters``, the members split evenly among them in order (the first ``size / len(datacenters)``
in the first one, ...): GossipingPropertyFileSnitch learns each member's data centre from its
``cassandra-rackdc.properties``, each data centre splits the ring evenly on its own (its tokens offset by
its index, so no two members share one), the first member of each is a seed, and the keyspace replicates
with NetworkTopologyStrategy to three members (or all, if fewer) of every data centre. A client names its
local data centre (``--cassandra-local-dc``): LOCAL_QUORUM counts there, and the writes reach the other
data centres asynchronously (EACH_QUORUM waits for them).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from localmesh.cassandra.node import CassandraNode, NodeConfig, NodeSetupError
from meshkit.launcher import Launcher

MURMUR3_MIN_TOKEN = -(2**63)
MAX_REPLICATION_FACTOR = 3


def ring_tokens(size: int) -> list[int]:
    """``size`` tokens spaced evenly over the Murmur3 ring, so each member owns an equal range."""
    return [MURMUR3_MIN_TOKEN + i * (2**64 // size) for i in range(size)]


@dataclass(frozen=True)
class ClusterConfig:
    data_dir: Path
    size: int = 1
    cql_port: int = 9042
    storage_port: int = 7000
    # Member i's JMX port is first_jmx_port + i (JMX listens on 127.0.0.1 for every member).
    first_jmx_port: int = 7199
    # A member of a bigger cluster gets a smaller heap: several share one laptop or CI box.
    member_heap_max: str = "512m"
    # The data centres the members split into, in order; none: one data centre ("datacenter1") that
    # SimpleSnitch gives every member.
    datacenters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.size <= 254:
            raise ValueError(f"a local cluster has 1 to 254 nodes, not {self.size}")
        if self.datacenters and self.size % len(self.datacenters):
            raise ValueError(
                f"{self.size} nodes do not split evenly into the data centres {', '.join(self.datacenters)}"
            )
        if len(set(self.datacenters)) != len(self.datacenters):
            raise ValueError(f"data centres named twice: {', '.join(self.datacenters)}")

    @property
    def members_per_datacenter(self) -> int:
        return self.size // max(len(self.datacenters), 1)

    def addresses(self) -> list[str]:
        return [f"127.0.0.{i + 1}" for i in range(self.size)]

    def addresses_in(self, datacenter: str) -> list[str]:
        """The addresses of the members of one data centre (a client's contact points there)."""
        first = self.datacenters.index(datacenter) * self.members_per_datacenter
        return self.addresses()[first : first + self.members_per_datacenter]

    def node_configs(self) -> list[NodeConfig]:
        addresses = self.addresses()
        if self.size == 1 and not self.datacenters:
            return [NodeConfig(self.data_dir, self.cql_port, self.storage_port, self.first_jmx_port)]
        per_dc = self.members_per_datacenter
        # Each data centre its own even ring, offset by its index: tokens are unique cluster-wide.
        tokens = [token + dc for dc in range(max(len(self.datacenters), 1)) for token in ring_tokens(per_dc)]
        return [
            NodeConfig(
                data_dir=self.data_dir / f"node-{i + 1}",
                cql_port=self.cql_port,
                storage_port=self.storage_port,
                jmx_port=self.first_jmx_port + i,
                heap_max=self.member_heap_max,
                address=address,
                seeds=tuple(addresses[::per_dc]),
                initial_token=token,
                cluster_size=self.size,
                datacenter=self.datacenters[i // per_dc] if self.datacenters else None,
            )
            for i, (address, token) in enumerate(zip(addresses, tokens, strict=True))
        ]

    def contact_points(self) -> list[str]:
        """``host:port`` of every member, as the services' repeatable ``--cassandra`` flag takes them."""
        return [f"{address}:{self.cql_port}" for address in self.addresses()]

    def replication(self) -> Mapping[str, str | int]:
        factor = min(self.members_per_datacenter, MAX_REPLICATION_FACTOR)
        if not self.datacenters:
            return {"class": "SimpleStrategy", "replication_factor": factor}
        return {"class": "NetworkTopologyStrategy", **dict.fromkeys(self.datacenters, factor)}

    def replication_flag(self) -> str:
        """The replication as the services' ``--cassandra-replication`` flag takes it."""
        replication = self.replication()
        if not self.datacenters:
            return f"SimpleStrategy:{replication['replication_factor']}"
        return "NetworkTopologyStrategy:" + ",".join(f"{dc}={replication[dc]}" for dc in self.datacenters)


class CassandraCluster:
    """The members of a local cluster, supervised by one ``Launcher``."""

    def __init__(self, config: ClusterConfig, launcher: Launcher) -> None:
        self.config = config
        self.nodes = [
            CassandraNode(node, launcher, name="cassandra" if config.size == 1 else f"cassandra-{i + 1}")
            for i, node in enumerate(config.node_configs())
        ]

    def start(self) -> float:
        """Starts the seed, then the other members at once; returns when every member answers CQL."""
        started = time.monotonic()
        seed, *others = self.nodes
        seed.start()
        for node in others:
            node.spawn()
        for node in others:
            node.wait_ready()
        if others:
            self._wait_converged(seed)
        elapsed = time.monotonic() - started
        if others:
            print(f"  Cassandra cluster of {len(self.nodes)} up in {elapsed:.1f}s", flush=True)
        return elapsed

    def _wait_converged(self, seed: CassandraNode, deadline_s: float = 60.0) -> None:
        """Waits until the seed's gossip shows every member holding one schema version. A member that
        answers CQL may not have met the others yet, and a client's schema agreement check
        (``Db.await_schema_agreement``) asks only the members the driver has heard of."""
        members = sorted(node.config.address for node in self.nodes)
        deadline = time.monotonic() + deadline_s
        while True:
            versions = seed.schema_versions()
            if len(versions) == 1 and sorted(next(iter(versions.values()))) == members:
                return
            if time.monotonic() > deadline:
                raise NodeSetupError(
                    f"the cluster did not converge in {deadline_s:.0f}s: schema versions {versions}"
                )
            time.sleep(1.0)

    def stop(self) -> None:
        """Drains and stops every member, the seed last."""
        for node in reversed(self.nodes):
            node.stop()
