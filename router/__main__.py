"""``python -m router``: the KV-cache-aware router (RouterService)."""

from __future__ import annotations

import asyncio
import logging
import sys

import grpc

from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from meshkit import serving, telemetry
from meshkit.config import ServiceArgs
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.policy import POLICIES
from router.registry import EngineRegistry
from router.service import RouterService

log = logging.getLogger("router")


def parse_args(argv: list[str] | None = None):
    d = RouterConfig()
    args = ServiceArgs("router", "Places generation requests on engines by KV-cache overlap and load.")
    args.add_server_flags(port=50051)
    args.add_list("engine", [], "engine [name=]host:port (repeat the flag for each engine)")
    args.add_list("engine-dns", [], "host:port whose addresses are all engines, re-resolved (repeatable)")
    args.add("dns-refresh-s", d.dns_refresh_s, "how often --engine-dns names are resolved again")
    args.add(
        "default-model", d.default_model, "model for requests that name none (empty: the only one served)"
    )
    args.add("policy", d.policy, f"placement policy: {' | '.join(POLICIES)}")
    args.add(
        "overlap-weight", d.weights.overlap, "kv_aware: weight of blocks to prefill against active blocks"
    )
    args.add(
        "temperature", d.weights.temperature, "kv_aware: 0 picks the cheapest engine; > 0 samples (softmax)"
    )
    args.add("free-queue-fraction", d.free_queue_fraction, "free tier is shed when every queue is this full")
    args.add("load-interval-ms", d.load_interval_ms, "engine load report period")
    args.add("accept-timeout-s", d.accept_timeout_s, "an engine must accept a request within this")
    args.add("first-token-timeout-s", d.first_token_timeout_s, "first token after accept (queueing included)")
    args.add("idle-timeout-s", d.idle_timeout_s, "longest silence between two frames of a started stream")
    args.add("max-request-s", d.max_request_s, "deadline of an engine call when the client set none")
    args.add("max-attempts", d.max_attempts, "placements per request: the first one plus failovers")
    args.add(
        "index-max-blocks-per-engine", d.index_max_blocks_per_engine, "bound on indexed blocks per engine"
    )
    return args.parse(argv)


async def serve(config: RouterConfig, args) -> None:
    metrics = RouterMetrics()
    registry = EngineRegistry(config, metrics)
    service = RouterService(registry, config, metrics)

    def add_services(server: grpc.aio.Server) -> list[str]:
        router_pb2_grpc.add_RouterServiceServicer_to_server(service, server)
        return [router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name]

    registry.start()
    if not config.engines and not config.engine_dns:
        log.warning("no engines configured (--engine / --engine-dns): every request will get UNAVAILABLE")
    try:
        await serving.serve("router", args, add_services, on_drain=service.drain)
    finally:
        await registry.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    telemetry.setup("router")
    try:
        config = RouterConfig.from_args(args)
    except ValueError as exc:
        log.error("cannot start the router: %s", exc)
        sys.exit(2)
    log.info(
        "policy %s, weights %s, engines %s",
        config.policy,
        config.weights,
        [e.address for e in config.engines],
    )
    asyncio.run(serve(config, args))


if __name__ == "__main__":
    main()
