"""The benchmarks' way to send a request straight to an engine or a router: on a ``meshkit.links.Link``,
the one transport the router and the orchestrator use on those hops (many requests on one
``GenerateMany`` stream to each peer), so what a benchmark times there is what production pays."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from meshkit.links import Link, LinkMessages

ENGINE = LinkMessages.of(engine_pb2)
ROUTER = LinkMessages.of(router_pb2)


def engine_link(channel: grpc.aio.Channel, peer: str = "the engine") -> Link:
    return Link(engine_pb2_grpc.EngineServiceStub(channel).GenerateMany, ENGINE, peer)


def router_link(channel: grpc.aio.Channel, peer: str = "the router") -> Link:
    return Link(router_pb2_grpc.RouterServiceStub(channel).GenerateMany, ROUTER, peer)


async def batches(link: Link, start: Any, **fields: Any) -> AsyncIterator[list[Any]]:
    """The request's frames (ResponseFrames: `accepted` or `routed`, `tokens`..., `finished`) as the
    caller gets them: every frame that arrived since its last take (more than one when it fell behind);
    a refusal or failure raises its ServiceError. ``fields``: the start frame's others (a router
    request's ``timeout_ms``). The request is released when the iteration ends, cancelled if early."""
    feed = link.open(start, {}, **fields)
    try:
        while batch := await feed.take():
            yield batch
    finally:
        link.release(start.request_id)


async def frames(link: Link, start: Any, **fields: Any) -> AsyncIterator[Any]:
    """The request's frames one by one, as ``batches`` gets them."""
    async for batch in batches(link, start, **fields):
        for frame in batch:
            yield frame
