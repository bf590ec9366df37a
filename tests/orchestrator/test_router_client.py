"""How the orchestrator picks a router (orchestrator/router_client.py), without a router: the addresses a
``--router`` value names, and a chat's router by rendezvous hashing."""

from __future__ import annotations

import pytest

from orchestrator.router_client import RouterClient, RouterReplica, router_addresses


@pytest.mark.parametrize(
    ("value", "addresses"),
    [
        ("127.0.0.1:50051", ["127.0.0.1:50051"]),
        ("10.0.0.1:50051,10.0.0.2:50051", ["10.0.0.1:50051", "10.0.0.2:50051"]),
        ("ipv4:10.0.0.1:50051,10.0.0.2:50051", ["10.0.0.1:50051", "10.0.0.2:50051"]),
        ("dns:///router-headless:50051", ["router-headless:50051"]),
    ],
)
def test_a_router_value_names_its_routers(value, addresses):
    assert router_addresses(value) == addresses


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
