"""The orchestrator tells the router which sends open a session (a chat's first message), and the
router spreads those over engines by the sessions each holds, not by the shared prefix they cache."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from tests.fixtures.orchestrator import ChatClient, MeshFactory, collect

# Shared by every chat below: ~8 blocks, so the engine caching it is cheaper for a chat that does not
# open a session (16 x 8 blocks less to prefill), and dearer for one that does, once it holds a session
# more (256 blocks a session: --session-weight, off by default).
INSTRUCTIONS = "You are a careful assistant who answers in one short sentence. " * 10


async def sessions_held(router: str) -> list[int]:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        engines = (await stub.ListEngines(router_pb2.ListEnginesRequest(), timeout=5)).engines
    return [engine.sessions_held for engine in engines]


async def test_new_chats_spread_over_engines_and_a_follow_up_stays_with_its_chat(
    start_mesh: MeshFactory, connect: Callable[..., ChatClient]
) -> None:
    mesh = start_mesh(2, "null", router_flags={"session_weight": 256})
    client = connect(mesh.orchestrator.address)
    first, second = await client.create_chat(), await client.create_chat()
    await collect(client.send(first.chat_id, "Hello?", instructions=INSTRUCTIONS))
    assert sorted(await sessions_held(mesh.router_address)) == [0, 1]
    # The engine that answered `first` caches the long shared instructions; only a new session's
    # placement counts the session it holds against it.
    await collect(client.send(second.chat_id, "Hi there?", instructions=INSTRUCTIONS))
    assert await sessions_held(mesh.router_address) == [1, 1]
    # A follow-up is no new session: it goes where its chat's history is cached, and moves nothing.
    await collect(client.send(first.chat_id, "And then?", instructions=INSTRUCTIONS))
    assert await sessions_held(mesh.router_address) == [1, 1]
