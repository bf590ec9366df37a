"""How the orchestrator picks a router (orchestrator/router_client.py), without a router: the addresses a
``--router`` value names, and a chat's router by rendezvous hashing."""

from __future__ import annotations

import pytest

from orchestrator.router_client import RouterClient, router_addresses


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


async def test_a_chat_keeps_its_router_chats_spread_and_a_tried_router_is_passed_over():
    # Nothing listens on these ports: every router is down, so each pick is among all of them.
    client = RouterClient("127.0.0.1:9,127.0.0.2:9,127.0.0.3:9", timeout_s=1.0, refresh_s=60.0)
    try:
        picks = {chat: (await client._pick(chat, set())).address for chat in (f"chat-{i}" for i in range(60))}
        assert picks == {chat: (await client._pick(chat, set())).address for chat in picks}  # stable
        assert set(picks.values()) == {"127.0.0.1:9", "127.0.0.2:9", "127.0.0.3:9"}
        first = picks["chat-0"]
        second = (await client._pick("chat-0", {first})).address
        assert second != first  # a placement the chat's router refused goes to another
        third = await client._pick("chat-0", {first, second})
        assert third is not None and third.address not in {first, second}
        assert await client._pick("chat-0", {first, second, third.address}) is None
        spread = {(await client._pick("", set())).address for _ in range(3)}
        assert len(spread) == 3  # requests of no chat go round-robin
    finally:
        await client.close()
