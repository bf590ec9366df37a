"""One metrics pattern for every component: a class whose ``__init__`` declares each of its Prometheus
metrics once, registered in the registry it is given (the process's by default; a fresh one in tests)::

    class RouterMetrics(ComponentMetrics):
        component = "router"

        def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
            super().__init__(registry)
            self.decisions = self.counter("decisions", "Placements made, by policy.", ["policy"])

A name means one thing. A component's own names get its prefix (``decisions`` is
``chatmesh_router_decisions``); names of the OpenTelemetry GenAI semantic conventions are kept as they are
(``gen_ai_...``), and ``gen_ai_server_*`` belongs to the engine alone: it is the GenAI server. What the
router or the orchestrator measure of the same thing (their time to first token) has their prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)
SEMCONV_PREFIX = "gen_ai_"
SERVER_PREFIX = "gen_ai_server_"
SERVER_COMPONENT = "engine"


class ComponentMetrics:
    component: ClassVar[str]

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry

    def name(self, name: str) -> str:
        """The exported name: a GenAI convention name as it is, any other with the component's prefix."""
        if name.startswith(SERVER_PREFIX) and self.component != SERVER_COMPONENT:
            raise ValueError(
                f"{name}: gen_ai_server_* metrics are the engine's; name it for the {self.component}"
            )
        return name if name.startswith(SEMCONV_PREFIX) else f"chatmesh_{self.component}_{name}"

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self.name(name), help, labels, registry=self.registry)

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.name(name), help, labels, registry=self.registry)

    def histogram(
        self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(self.name(name), help, labels, buckets=buckets, registry=self.registry)
