"""``python -m router``: the KV-cache-aware router (RouterService)."""

from __future__ import annotations

import argparse
import logging

import grpc

from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from meshkit import event_loop, serving, telemetry
from meshkit.config import ServiceArgs
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.registry import EngineRegistry
from router.service import RouterService

log = logging.getLogger("router")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, RouterConfig]:
    args = ServiceArgs("router", "Places generation requests on engines by KV-cache overlap and load.")
    args.add_server_flags(port=50051)
    args.add_config(RouterConfig)
    return args.config(RouterConfig, argv)


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
    args, config = parse_args(argv)
    telemetry.setup("router")
    log.info(
        "policy %s, weights %s, engines %s",
        config.policy,
        config.weights,
        [e.address for e in config.engines],
    )
    event_loop.run(serve(config, args))


if __name__ == "__main__":
    main()
