"""``python -m router``: the KV-cache-aware router (RouterService)."""

from __future__ import annotations

import asyncio

import grpc

from chatmesh import serving, telemetry
from chatmesh.config import ServiceArgs
from chatmesh.router.v1 import router_pb2, router_pb2_grpc


def parse_args(argv: list[str] | None = None):
    args = ServiceArgs("router", "Places generation requests on engines by KV-cache overlap and load.")
    args.add_server_flags(port=50051)
    args.add_list("engine", [], "engine address host:port (repeat the flag for each engine)")
    return args.parse(argv)


def add_services(server: grpc.aio.Server) -> list[str]:
    router_pb2_grpc.add_RouterServiceServicer_to_server(router_pb2_grpc.RouterServiceServicer(), server)
    return [router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    telemetry.setup("router")
    asyncio.run(serving.serve("router", args, add_services))


if __name__ == "__main__":
    main()
