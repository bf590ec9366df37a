"""One metrics pattern: a name means one thing."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from meshkit.metrics import ComponentMetrics


class Router(ComponentMetrics):
    component = "router"


class Engine(ComponentMetrics):
    component = "engine"


def test_a_components_names_get_its_prefix_and_genai_names_stay_as_they_are():
    metrics = Router(CollectorRegistry())
    assert metrics.name("decisions") == "chatmesh_router_decisions"
    assert metrics.name("gen_ai_client_token_usage") == "gen_ai_client_token_usage"
    assert (
        Engine(CollectorRegistry()).name("gen_ai_server_request_duration_seconds").startswith("gen_ai_server")
    )


def test_only_the_engine_measures_as_the_genai_server():
    with pytest.raises(ValueError, match="engine's"):
        Router(CollectorRegistry()).histogram("gen_ai_server_time_to_first_token_seconds", "ttft")
