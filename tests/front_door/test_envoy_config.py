"""The Envoy config template renders to a config that `envoy --mode validate` accepts, and says what the
front door promises (routes for every ChatService RPC, stream timeouts, identity stripping, limits)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from chatmesh.chat.v1 import chat_pb2
from chatmesh.identity import TIER_HEADER, USER_ID_HEADER
from localmesh.dev_jwt import ISSUER, DevKeys
from meshkit.envoy import EnvoyConfig, InvalidEnvoyConfigError, render_config, validate, write_config


@pytest.fixture
def config(dev_jwt_keys: DevKeys) -> EnvoyConfig:
    return EnvoyConfig(
        listen_port=18080,
        admin_port=19901,
        jwks_path=dev_jwt_keys.jwks_path,
        edge_endpoints=(("127.0.0.1", 18081),),
        orchestrator_endpoints=(("127.0.0.1", 50050), ("127.0.0.1", 50060)),
        jwt_issuer=ISSUER,
        cors_origins=("http://127.0.0.1:18080",),
    )


@pytest.mark.parametrize("otlp", [None, ("127.0.0.1", 4317)], ids=["no-tracing", "opentelemetry"])
def test_rendered_config_passes_envoy_validate(config: EnvoyConfig, tmp_path, otlp):
    write_config(replace(config, otlp=otlp), tmp_path / "envoy.yaml")  # raises if envoy rejects it


def test_validate_rejects_a_broken_config(config: EnvoyConfig, tmp_path):
    path = tmp_path / "envoy.yaml"
    path.write_text(render_config(config).replace("lb_policy: RING_HASH", "lb_policy: RING_HASHISH"))
    with pytest.raises(InvalidEnvoyConfigError, match="RING_HASHISH"):
        validate(path)


def routes(parsed: dict, listener: str) -> list[dict]:
    (found,) = [item for item in parsed["static_resources"]["listeners"] if item["name"] == listener]
    manager = found["filter_chains"][0]["filters"][0]["typed_config"]
    return manager["route_config"]["virtual_hosts"][0]["routes"]


def test_every_chat_service_rpc_is_routed_with_the_right_timeouts(config: EnvoyConfig):
    parsed = yaml.safe_load(render_config(config))
    service = chat_pb2.DESCRIPTOR.services_by_name["ChatService"]
    assert [listener["name"] for listener in parsed["static_resources"]["listeners"]] == ["public"]
    by_path = {r["match"].get("path"): r["route"] for r in routes(parsed, "public")}
    for method in service.methods:
        route = by_path[f"/{service.full_name}/{method.name}"]
        assert route["cluster"] == "orchestrator"
        assert route["hash_policy"] == [{"header": {"header_name": "x-chatmesh-chat-id"}}]
        if method.server_streaming:
            assert route["timeout"] == "0s" and route["idle_timeout"] == "300s"
        else:
            assert route["timeout"] == "30s"
        retried = "unavailable" in route["retry_policy"]["retry_on"]
        assert retried == (
            method.name
            in {
                "GetChat",
                "ListChats",
                "ListMessages",
                "GetBranch",
                "GetRun",
                "CancelRun",
                "ListModels",
                "GetUsage",
                "SearchChats",
            }
        )


def test_identity_headers_are_stripped_before_any_filter(config: EnvoyConfig):
    parsed = yaml.safe_load(render_config(config))
    public = parsed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    mutations = public["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {m["remove"] for m in mutations} == {USER_ID_HEADER, TIER_HEADER}
    filters = [f["name"] for f in public["http_filters"]]
    assert filters.index("envoy.filters.http.jwt_authn") < filters.index("envoy.filters.http.local_ratelimit")
    assert filters[-1] == "envoy.filters.http.router"


def test_orchestrator_cluster_is_sized_for_streams(config: EnvoyConfig):
    parsed = yaml.safe_load(render_config(config))
    (cluster,) = [c for c in parsed["static_resources"]["clusters"] if c["name"] == "orchestrator"]
    assert cluster["lb_policy"] == "RING_HASH"
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] >= 10_000
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == "chatmesh.chat.v1.ChatService"
    # A busy replica answers its health late, not unhealthy: up to 3.0 s at twice what it relays
    # (bench_front_door), which must not eject it.
    assert float(cluster["health_checks"][0]["timeout"].removesuffix("s")) > 3.0
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2


def test_every_stream_limit_follows_max_open_streams(config: EnvoyConfig):
    """No Envoy default caps open streams below the configured number: the clusters' circuit breakers
    (requests, and requests waiting for a connection) and HTTP/2's concurrent streams on one connection
    (a gRPC client's connection; Envoy's connection to an orchestrator)."""
    parsed = yaml.safe_load(render_config(replace(config, max_open_streams=123_456)))
    resources = parsed["static_resources"]
    for cluster in resources["clusters"]:
        (limits,) = cluster["circuit_breakers"]["thresholds"]
        assert limits["max_requests"] == limits["max_pending_requests"] == 123_456, cluster["name"]
    (orchestrator,) = [c for c in resources["clusters"] if c["name"] == "orchestrator"]
    upstream = orchestrator["typed_extension_protocol_options"]
    options = upstream["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    assert options["http2_protocol_options"]["max_concurrent_streams"] == 123_456
    for listener in resources["listeners"]:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        assert manager["http2_protocol_options"]["max_concurrent_streams"] == 123_456, listener["name"]
    connections = parsed["overload_manager"]["resource_monitors"][0]["typed_config"]
    assert connections["max_active_downstream_connections"] == 123_456
