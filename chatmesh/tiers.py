"""Service tiers: the one table of a tier's name (JWT claim, budgets, flags, metric labels), its
``router.v1.Tier`` on the wire, the ``engine.v1.Priority`` the router asks engines to schedule it at, and
its time-to-first-token objective (the router admits a request only where its predicted wait fits it).

The objectives: enterprise 0.5 s is the seeds' TTFT target (docs/operations/capacity.md); free 2 s is the
operations SLO's threshold (docs/operations/monitoring.md); pro sits between. They are defaults: the router takes
``--ttft-objective-<tier>-s``. A stricter objective for a higher tier is not a harsher rule for it:
engines schedule higher priorities first, so a request waits only behind its own tier and those above.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatmesh.engine.v1 import engine_pb2
from chatmesh.router.v1 import router_pb2


@dataclass(frozen=True)
class Tier:
    name: str
    proto: router_pb2.Tier
    priority: engine_pb2.Priority
    ttft_objective_s: float  # default; the router's --ttft-objective-<name>-s
    rank: int  # position in the table, lowest first: an engine serves higher ranks first


_TABLE = (
    Tier("free", router_pb2.TIER_FREE, engine_pb2.PRIORITY_LOW, 2.0, 0),
    Tier("pro", router_pb2.TIER_PRO, engine_pb2.PRIORITY_NORMAL, 1.0, 1),
    Tier("enterprise", router_pb2.TIER_ENTERPRISE, engine_pb2.PRIORITY_HIGH, 0.5, 2),
)
TIERS = tuple(tier.name for tier in _TABLE)
TTFT_OBJECTIVES_S = {tier.name: tier.ttft_objective_s for tier in _TABLE}
# The lowest tier: what an unknown or unset tier is treated as, never trusted higher.
DEFAULT_TIER = "free"
_BY_NAME = {tier.name: tier for tier in _TABLE}
_BY_PROTO: dict[int, Tier] = {int(tier.proto): tier for tier in _TABLE} | {
    router_pb2.TIER_UNSPECIFIED: _BY_NAME[DEFAULT_TIER]
}
# engine.v1 says PRIORITY_UNSPECIFIED is treated as PRIORITY_NORMAL.
_PRIORITIES: dict[int, engine_pb2.Priority] = {int(tier.priority): tier.priority for tier in _TABLE} | {
    engine_pb2.PRIORITY_UNSPECIFIED: engine_pb2.PRIORITY_NORMAL
}


def tier_named(name: str) -> Tier:
    """The tier of a name; an unknown name is the default (lowest) tier."""
    return _BY_NAME.get(name, _BY_NAME[DEFAULT_TIER])


def tier_of_proto(value: int) -> Tier:
    """The tier of a ``router.v1.Tier`` value; UNSPECIFIED (or unknown) is the default (lowest) tier."""
    return _BY_PROTO.get(value, _BY_NAME[DEFAULT_TIER])


def is_tier_proto(value: int) -> bool:
    """Whether a ``router.v1.Tier`` value is one this version knows (UNSPECIFIED included)."""
    return value in _BY_PROTO


def engine_priority(value: int) -> engine_pb2.Priority | None:
    """An ``engine.v1.Priority`` as the engine schedules it (UNSPECIFIED is NORMAL); None if unknown."""
    return _PRIORITIES.get(value)
