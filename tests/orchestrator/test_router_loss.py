"""Losing a router mid-answer: the orchestrator goes on through another router, exactly.

Two real routers over the shared mesh's null engines, one orchestrator that knows both
(``--router a,b``). The router carrying an answer is killed (-9) while a client streams it; the same
stream goes on, with no gap and no duplicate, and the stored answer is the streamed one and the one
an undisturbed run gives.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from meshkit.launcher import free_port
from tests.fixtures.answers import (
    ANSWER,
    QUESTION,
    assert_answer_complete_and_stored,
    undisturbed_answer,
)
from tests.fixtures.orchestrator import (
    ChatClient,
    Mesh,
    OrchestratorProcess,
    answer_text,
    collect,
    events,
    read_until,
)
from tests.fixtures.router import router_spec, wait_for_engines


@pytest.fixture
def routers(mesh: Mesh) -> Iterator[dict[str, str]]:
    """Two routers of their own over the mesh's engines: name -> address."""
    started = {}
    for _ in range(2):
        name, port = f"router-twin-{free_port()}", free_port()
        mesh.launcher.start(router_spec(name, port, mesh.engines, drain_grace_s=1.0))
        started[name] = f"127.0.0.1:{port}"
    for address in started.values():
        wait_for_engines(address, len(mesh.engines))
    yield started
    for name in started:
        mesh.launcher.stop(name)


def carrying(routers: dict[str, str]) -> str:
    """The router with a request in flight."""
    for name, address in routers.items():
        with grpc.insecure_channel(address) as channel:
            engines = (
                router_pb2_grpc.RouterServiceStub(channel)
                .ListEngines(router_pb2.ListEnginesRequest(), timeout=5)
                .engines
            )
        if sum(e.inflight_requests for e in engines):
            return name
    raise AssertionError("no router carries the answer")


@pytest.fixture
def replica(mesh: Mesh, routers: dict[str, str]) -> Iterator[OrchestratorProcess]:
    """An orchestrator that knows both routers."""
    process = mesh.start_orchestrator(router=",".join(routers.values()))
    yield process
    mesh.stop_orchestrator(process)


async def answer_under_way(
    client: ChatClient,
) -> tuple[chat_pb2.Chat, grpc.aio.UnaryStreamCall, list[chat_pb2.RunEvent]]:
    """A long answer, its first 30 events read (the rest still to come on ``call``)."""
    chat = await client.create_chat()
    call = client.send(chat.chat_id, QUESTION, options=ANSWER)
    return chat, call, await read_until(call, 30)


async def test_an_answer_whose_router_dies_goes_on_through_another_router(
    mesh: Mesh, routers: dict[str, str], replica: OrchestratorProcess, connect: Callable[..., ChatClient]
) -> None:
    client = connect(replica.address)
    chat, call, seen = await answer_under_way(client)
    victim = carrying(routers)
    mesh.launcher.signal(victim, signal.SIGKILL)
    mesh.launcher.forget(victim)
    del routers[victim]

    # The client's stream never broke.
    seen += [event async for event in events(call)]
    await assert_answer_complete_and_stored(
        client, chat.chat_id, seen[0].started.run_id, seen, await undisturbed_answer(client)
    )
    # And answers keep coming through the router left.
    again = await client.create_chat()
    assert answer_text(await collect(client.send(again.chat_id, QUESTION, options=ANSWER))) == answer_text(
        seen
    )


async def test_a_router_restarted_under_load_fails_no_answer(
    mesh: Mesh, routers: dict[str, str], replica: OrchestratorProcess, connect: Callable[..., ChatClient]
) -> None:
    client = connect(replica.address)
    chat, call, seen = await answer_under_way(client)
    victim = carrying(routers)
    # SIGTERM: it refuses new work at once, lets its streams run for its drain grace, then exits.
    mesh.launcher.signal(victim, signal.SIGTERM)
    others = [await client.create_chat() for _ in range(3)]  # with the long one: the tier's 4 at once
    short = chat_pb2.GenerationOptions(max_tokens=20)
    answers = await asyncio.gather(*(collect(client.send(c.chat_id, "Hi", options=short)) for c in others))
    assert all(a[-1].HasField("done") for a in answers), [a[-1] for a in answers]

    seen += [event async for event in events(call)]
    await assert_answer_complete_and_stored(
        client, chat.chat_id, seen[0].started.run_id, seen, await undisturbed_answer(client)
    )


async def test_a_chats_answers_go_through_one_router_while_it_is_up(
    routers: dict[str, str], replica: OrchestratorProcess, connect: Callable[..., ChatClient]
) -> None:
    # The router that placed a chat's last turn holds its session hint (router/sessions.py): the chat's
    # next turns must reach it (round-robin would send a chat's second turn to the other router).
    client = connect(replica.address)
    placed: dict[str, set[str]] = {}
    for _ in range(4):
        chat = await client.create_chat()
        for turn in range(2):
            seen = await read_until(client.send(chat.chat_id, f"{QUESTION} ({turn})", options=ANSWER), 3)
            placed.setdefault(chat.chat_id, set()).add(carrying(routers))
            run_id = seen[0].started.run_id
            await client.call("CancelRun", chat_pb2.CancelRunRequest(run_id=run_id))
            await wait_until_idle(routers)
    assert all(len(used) == 1 for used in placed.values()), placed


async def wait_until_idle(routers: dict[str, str], timeout_s: float = 10.0) -> None:
    """Until no router has a request in flight (a cancelled answer's end has reached them)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            carrying(routers)
        except AssertionError:
            return
        assert asyncio.get_running_loop().time() < deadline, "a cancelled answer is still in flight"
        await asyncio.sleep(0.05)
