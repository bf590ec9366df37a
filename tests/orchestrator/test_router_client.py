"""The orchestrator's side of the routers (orchestrator/router_client.py), without a router: the
addresses a ``--router`` value names, a chat's router by rendezvous hashing, and the order in which a
request's frames reach the run."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.router.v1 import router_pb2
from meshkit.links import RequestFeed
from meshkit.replicas import addresses
from orchestrator.router_client import GenerateStream, RouterClient, RouterReplica


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:50051", ["127.0.0.1:50051"]),
        ("10.0.0.1:50051,10.0.0.2:50051", ["10.0.0.1:50051", "10.0.0.2:50051"]),
        ("ipv4:10.0.0.1:50051,10.0.0.2:50051", ["10.0.0.1:50051", "10.0.0.2:50051"]),
        ("dns:///router-headless:50051", ["router-headless:50051"]),
    ],
)
def test_a_router_value_names_its_routers(value, expected):
    assert addresses(value) == expected


async def test_a_chat_keeps_its_router_while_it_is_up_chats_spread_and_a_tried_router_is_passed_over(
    monkeypatch,
):
    down: set[str] = set()  # which routers' channels are down, as the test says
    monkeypatch.setattr(RouterReplica, "down", property(lambda router: router.address in down))
    client = RouterClient("127.0.0.1:9,127.0.0.2:9,127.0.0.3:9", timeout_s=1.0, refresh_s=60.0)

    async def pick(chat: str, tried: frozenset[str] = frozenset()) -> str | None:
        router = await client._pick(chat, set(tried))
        return None if router is None else router.address

    try:
        chats = [f"chat-{i}" for i in range(60)]
        picks = {chat: await pick(chat) for chat in chats}
        assert picks == {chat: await pick(chat) for chat in chats}  # stable while the routers stay up
        assert set(picks.values()) == {"127.0.0.1:9", "127.0.0.2:9", "127.0.0.3:9"}  # chats spread
        home = picks["chat-0"]
        down.add(home)  # its router goes down: the chat moves, and only the chats of that router do
        moved = {chat: await pick(chat) for chat in chats}
        assert moved["chat-0"] != home
        assert all(moved[chat] == picks[chat] for chat in chats if picks[chat] != home)
        down.clear()
        assert await pick("chat-0") == home  # and comes back once it is up
        second = await pick("chat-0", frozenset({home}))  # a router that refused the placement
        assert second not in {home, None}
        third = await pick("chat-0", frozenset({home, second}))
        assert third not in {home, second, None}
        assert await pick("chat-0", frozenset({home, second, third})) is None
        assert len({await pick("") for _ in range(3)}) == 3  # requests of no chat go round-robin
    finally:
        await client.close()


def routed(attempt: int) -> router_pb2.ResponseFrame:
    return router_pb2.ResponseFrame(request_id="q", routed=router_pb2.GenerateRouted(attempt=attempt))


def tokens(index: int) -> router_pb2.ResponseFrame:
    return router_pb2.ResponseFrame(
        request_id="q", tokens=engine_pb2.GenerateTokens(index=index, token_ids=[index], text=str(index))
    )


async def test_a_requests_tokens_reach_the_run_in_order_whether_they_waited_or_came_as_it_ran():
    feed = RequestFeed()
    link = SimpleNamespace(open=lambda start, context, timeout_ms: feed, release=lambda request_id: None)
    stream = GenerateStream(SimpleNamespace(address="r", link=link), router_pb2.GenerateStart(request_id="q"))
    feed.add(routed(1))
    feed.add(tokens(0))  # arrived with `routed`
    await stream.open(deadline_s=10, placement_timeout_s=1)
    feed.add(tokens(1))  # arrived before the run came for its frames
    handed: list[int] = []
    others: list[str] = []

    async def run() -> None:
        async for frame in stream.frames(lambda payload: handed.append(payload.index)):
            others.append(frame.WhichOneof("kind"))

    running = asyncio.create_task(run())
    await asyncio.sleep(0)
    assert handed == [0, 1]  # the waiting ones first, in order
    feed.add(tokens(2))  # from here on, handed over as they arrive
    assert handed == [0, 1, 2]
    feed.add(routed(2))  # a failover on the router: the run's task wakes for it
    feed.add(tokens(3))  # behind it: waits for it
    assert handed == [0, 1, 2]
    feed.add(router_pb2.ResponseFrame(request_id="q", finished=engine_pb2.GenerateFinished()))
    await running
    assert handed == [0, 1, 2, 3] and others == ["routed", "finished"]
    assert stream.routed.attempt == 2
