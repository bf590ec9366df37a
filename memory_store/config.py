"""How a service reaches its Cassandra cluster: one dataclass whose settings are flags.

A service holds it as ``nested(StoreConfig)`` (meshkit.config): ``--cassandra host:port``, repeatable,
then ``--cassandra-keyspace``, ``--cassandra-replication``, ...; each with a ``CHATMESH_<SERVICE>_<FLAG>``
environment default, like every chatmesh flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from chatmesh.limits import Limits
from memory_store.models import StoreBounds
from memory_store.security import CassandraSecurity
from meshkit.config import nested, setting

LOCAL_REPLICATION: Mapping[str, str | int] = {"class": "SimpleStrategy", "replication_factor": 1}


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


def _hosts(contacts: list[str]) -> tuple[str, ...]:
    return tuple(contact.rpartition(":")[0] or contact for contact in contacts)


def _port(contacts: list[str]) -> int:
    ports = {int(port) if host else 9042 for host, _, port in (c.rpartition(":") for c in contacts)}
    if len(ports) != 1:
        raise ValueError("all --cassandra contact points must use the same port")
    return ports.pop()


@dataclass(frozen=True)
class StoreConfig:
    contact_points: tuple[str, ...] = setting(
        ("127.0.0.1",),
        "Cassandra contact point host:port (repeatable)",
        flag="cassandra",
        flag_default=["127.0.0.1:9042"],
        parse=_hosts,
        repeat=True,
    )
    port: int = setting(9042, flag="cassandra", parse=_port)
    keyspace: str = setting(
        "chatmesh", "keyspace holding chats, messages, runs and usage", flag="cassandra-keyspace"
    )
    # SimpleStrategy RF=1 for one local node; NetworkTopologyStrategy with RF=3 per DC in production.
    replication: Mapping[str, str | int] = setting(
        default_factory=lambda: dict(LOCAL_REPLICATION),
        help="keyspace replication when it is created",
        flag="cassandra-replication",
        flag_default="SimpleStrategy:1",
        parse=parse_replication,
    )
    local_dc: str = setting(
        "datacenter1", "the local datacenter (LOCAL_QUORUM is counted there)", flag="cassandra-local-dc"
    )
    request_timeout_s: float = setting(5.0, "timeout of one Cassandra request", flag="cassandra-timeout-s")
    # A send stores its question and its run in one logged batch up to this size (one round trip, all
    # or nothing); larger ones take two. Keep it under the cluster's batch_size_fail_threshold.
    max_batch_bytes: int = setting(
        40 * 1024,
        "largest batch across partitions (under the cluster's batch_size_fail_threshold; 0: none)",
        flag="cassandra-max-batch-bytes",
    )
    security: CassandraSecurity = nested(CassandraSecurity)
    # Apply schema migrations at connect (local runs and tests); deployments run them once, as a job.
    apply_schema: bool = setting(True, "apply schema migrations at start", flag="cassandra-apply-schema")
    # Length of a usage (budget) window, aligned to the Unix epoch: 86400 is a UTC day.
    usage_window_s: int = 86_400
    # How long an idempotency key keeps mapping to its run (or a CreateChat key to its chat).
    idempotency_ttl_s: int = 7 * 86_400
    # The request limits, as the orchestrator's flags set them; the store checks writes against them too.
    limits: Limits = field(default_factory=Limits)
    bounds: StoreBounds = field(default_factory=StoreBounds)
