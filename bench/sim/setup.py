"""What one simulation run is: the fleet, the routers, the policy, the engines' costs and the workload."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.sim.costs import EngineCosts
from bench.sim.workload import Workload
from router.config import RouterConfig


@dataclass(frozen=True)
class Setup:
    engines: int = 1000
    routers: int = 1  # replicas, each following every engine's events
    policy: str = "kv_aware"
    admission: str = "wait"  # the router's --admission rule
    costs: EngineCosts = field(default_factory=EngineCosts)
    workload: Workload = field(default_factory=Workload)
    load_interval_s: float = 0.1  # the router's default --load-interval-ms
    # KV events reach the routers this long after the engine stored or evicted the blocks (0: at once).
    event_lag_s: float = 0.0
    session_hints: int = RouterConfig.session_hints  # the router's --session-hints (0: off)
    fail_engine_at_s: float = -1.0  # < 0: no failure; else engine 0 dies then (its requests fail over)
    # Requests arriving before this are not in the figures (< 0: 1.5 ramps, when the chats that joined
    # cold during the ramp have come back at least once).
    measure_from_s: float = -1.0
