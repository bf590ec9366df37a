"""How a service reaches its Cassandra cluster: one dataclass, and the flags that fill it.

Services add the flags with ``add_store_flags(args)`` (``--cassandra host:port``, repeatable, then
``--cassandra-keyspace``, ``--cassandra-replication``, ...; each with a ``CHATMESH_<SERVICE>_<FLAG>``
environment default, like every chatmesh flag) and build the config with ``StoreConfig.from_args``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from chatmesh.limits import Limits
from memory_store.models import StoreBounds
from meshkit.config import ServiceArgs

LOCAL_REPLICATION: Mapping[str, str | int] = {"class": "SimpleStrategy", "replication_factor": 1}


@dataclass(frozen=True)
class StoreConfig:
    contact_points: tuple[str, ...] = ("127.0.0.1",)
    port: int = 9042
    keyspace: str = "chatmesh"
    # SimpleStrategy RF=1 for one local node; NetworkTopologyStrategy with RF=3 per DC in production.
    replication: Mapping[str, str | int] = field(default_factory=lambda: dict(LOCAL_REPLICATION))
    local_dc: str = "datacenter1"
    request_timeout_s: float = 5.0
    # Apply schema migrations at connect (local runs and tests); deployments run them once, as a job.
    apply_schema: bool = True
    # Length of a usage (budget) window, aligned to the Unix epoch: 86400 is a UTC day.
    usage_window_s: int = 86_400
    # How long an idempotency key keeps mapping to its run.
    idempotency_ttl_s: int = 7 * 86_400
    # The request limits, as the orchestrator's flags set them; the store checks writes against them too.
    limits: Limits = field(default_factory=Limits)
    bounds: StoreBounds = field(default_factory=StoreBounds)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StoreConfig:
        hosts, ports = [], set()
        for contact in args.cassandra:
            host, _, port = contact.rpartition(":")
            hosts.append(host or contact)
            ports.add(int(port) if host else 9042)
        if len(ports) != 1:
            raise argparse.ArgumentTypeError("all --cassandra contact points must use the same port")
        return cls(
            contact_points=tuple(hosts),
            port=ports.pop(),
            keyspace=args.cassandra_keyspace,
            replication=parse_replication(args.cassandra_replication),
            local_dc=args.cassandra_local_dc,
            request_timeout_s=args.cassandra_timeout_s,
            apply_schema=args.cassandra_apply_schema,
        )


def parse_replication(text: str) -> dict[str, str | int]:
    """'SimpleStrategy:1' or 'NetworkTopologyStrategy:dc1=3,dc2=3' as a CQL replication map."""
    strategy, _, rest = text.partition(":")
    if strategy == "SimpleStrategy":
        return {"class": strategy, "replication_factor": int(rest or "1")}
    if strategy == "NetworkTopologyStrategy" and rest:
        dcs = dict(part.split("=", 1) for part in rest.split(","))
        return {"class": strategy, **{dc.strip(): int(rf) for dc, rf in dcs.items()}}
    raise argparse.ArgumentTypeError(
        f"replication {text!r}: expected SimpleStrategy:<rf> or NetworkTopologyStrategy:<dc>=<rf>,..."
    )


def add_store_flags(args: ServiceArgs) -> None:
    args.add_list("cassandra", ["127.0.0.1:9042"], "Cassandra contact point host:port (repeatable)")
    args.add("cassandra-keyspace", "chatmesh", "keyspace holding chats, messages, runs and usage")
    args.add("cassandra-replication", "SimpleStrategy:1", "keyspace replication when it is created")
    args.add("cassandra-local-dc", "datacenter1", "the local datacenter (LOCAL_QUORUM is counted there)")
    args.add("cassandra-timeout-s", 5.0, "timeout of one Cassandra request")
    args.add("cassandra-apply-schema", True, "apply schema migrations at start")
