"""meshkit/replicas.py against real gRPC servers on loopback: a replica's health as it watches it, and
which replica a key or a call goes to. (Rendezvous hashing and round-robin over replicas that are down
or were tried: tests/orchestrator/test_router_client.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from meshkit.replicas import Replica, Replicas, addresses
from meshkit.serving import GrpcServer, start_grpc_server


@pytest.fixture
async def server() -> AsyncIterator[GrpcServer]:
    handle = await start_grpc_server(lambda server: (), 0)
    yield handle
    await handle.server.stop(None)


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_value_names_its_replicas() -> None:
    assert addresses("dns:///orchestrator-headless:50050") == ["orchestrator-headless:50050"]
    assert addresses(" 10.0.0.1:1 , 10.0.0.2:1,") == ["10.0.0.1:1", "10.0.0.2:1"]


async def test_a_replica_is_down_while_its_health_says_not_serving_and_up_again_after(server: GrpcServer):
    replica = Replica(f"127.0.0.1:{server.port}")
    try:
        await until(
            lambda: not replica.down and replica.channel.get_state() == grpc.ChannelConnectivity.READY
        )
        assert not replica.down
        await server.set_serving(False)
        await until(lambda: replica.down)
        await server.set_serving(True)
        await until(lambda: not replica.down)  # asked again a second later
    finally:
        await replica.close()


async def test_the_watch_does_not_hold_a_draining_server_open(server: GrpcServer):
    replica = Replica(f"127.0.0.1:{server.port}")
    try:
        await until(
            lambda: not replica.down and replica.channel.get_state() == grpc.ChannelConnectivity.READY
        )
        await asyncio.sleep(0.2)  # the watch is open
        started = time.monotonic()
        await server.drain(grace_s=10.0)  # NOT_SERVING, then the server waits for its open calls
        assert time.monotonic() - started < 3.0  # the watch let go as it heard NOT_SERVING
        assert replica.down
    finally:
        await replica.close()


async def test_a_peer_without_the_health_service_serves_while_it_can_be_reached():
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    replica = Replica(f"127.0.0.1:{port}")
    try:
        assert not replica.down  # asked: it watches from now on
        await until(lambda: replica._health is not None and replica._health.done())  # UNIMPLEMENTED
        assert not replica.down
        await server.stop(None)
        await until(lambda: replica.down)  # its channel cannot connect
    finally:
        await replica.close()


async def test_keys_and_calls_pass_over_a_replica_that_is_not_serving():
    first = await start_grpc_server(lambda server: (), 0)
    second = await start_grpc_server(lambda server: (), 0)
    replicas: Replicas[Replica] = Replicas(f"127.0.0.1:{first.port},127.0.0.1:{second.port}", Replica)
    try:
        await replicas.ready()
        await until(lambda: all(not replica.down for replica in replicas.members))
        keys = [f"chat-{n}" for n in range(40)]
        homes = {key: replicas.pick(key) for key in keys}
        assert len({replica.address for replica in homes.values() if replica}) == 2
        drained, up = sorted(
            replicas.members, key=lambda replica: replica.address != f"127.0.0.1:{first.port}"
        )
        await first.set_serving(False)
        await until(lambda: drained.down)
        assert {replicas.pick(key) for key in keys} == {up}  # its keys moved; the others stayed
        assert replicas.pick("") is up and replicas.pick("") is up  # round-robin over those up
        assert replicas.candidates({up.address}) == [drained]  # tried them all: the rest, down or not
    finally:
        await replicas.close()
        for handle in (first, second):
            await handle.server.stop(None)
