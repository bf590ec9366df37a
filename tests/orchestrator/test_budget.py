"""Token budgets on a real Cassandra: reserve at admission, reconcile with actual tokens, refuse with a
retry delay when the window is spent, and recover when the window resets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import retry_after_s
from tests.fixtures.orchestrator import ChatClient, Mesh, OrchestratorProcess, collect, events

WINDOW_S = 5
BUDGET = 300

pytestmark = pytest.mark.usefixtures("router_required")


@pytest.fixture(scope="module")
def budgeted(mesh: Mesh) -> Iterator[OrchestratorProcess]:
    with mesh.replica(budget_window_s=WINDOW_S, budget_pro_tokens=BUDGET) as replica:
        yield replica


@pytest.fixture
def budget_client(budgeted: OrchestratorProcess, connect: Callable[..., ChatClient]) -> ChatClient:
    return connect(budgeted.address)


def opts(max_tokens: int) -> chat_pb2.GenerationOptions:
    return chat_pb2.GenerationOptions(max_tokens=max_tokens)


async def usage(client: ChatClient) -> chat_pb2.GetUsageResponse:
    return await client.call("GetUsage", chat_pb2.GetUsageRequest())


async def start_of_a_window() -> None:
    """Waits until a window has just begun, so a test's sends all land in one window."""
    await asyncio.sleep(WINDOW_S - time.time() % WINDOW_S + 0.05)


async def test_a_spent_budget_is_refused_with_the_time_until_the_window_resets_and_then_recovers(
    budget_client: ChatClient,
) -> None:
    # Each send in a chat of its own, so every estimate is the same: a short prompt + 150.
    chats = [(await budget_client.create_chat()).chat_id for _ in range(3)]
    await start_of_a_window()
    first = await collect(budget_client.send(chats[0], "hello", options=opts(150)))
    spent = first[-2].usage.prompt_tokens + first[-2].usage.completion_tokens
    report = await usage(budget_client)
    assert (report.tier, report.used_tokens, report.limit_tokens) == ("pro", spent, BUDGET)
    assert report.window_end_time.seconds - report.window_start_time.seconds == WINDOW_S

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(budget_client.send(chats[1], "again", options=opts(150)))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    delay = retry_after_s(caught.value)
    assert delay is not None and 0 < delay <= WINDOW_S
    assert "budget" in caught.value.details()

    await asyncio.sleep(delay + 0.2)
    recovered = await collect(budget_client.send(chats[2], "again", options=opts(150)))
    assert recovered[-1].HasField("done")


async def test_a_run_is_charged_its_actual_tokens_not_its_reservation(budget_client: ChatClient) -> None:
    chat = await budget_client.create_chat()
    await start_of_a_window()
    call = budget_client.send(chat.chat_id, "count", options=opts(200))
    started = await anext(events(call))
    await budget_client.call("CancelRun", chat_pb2.CancelRunRequest(run_id=started.started.run_id))
    run = [started, *await collect(call)]
    actual = run[-2].usage.prompt_tokens + run[-2].usage.completion_tokens
    assert run[-2].usage.completion_tokens < 200
    assert (await usage(budget_client)).used_tokens == actual


async def test_a_request_larger_than_the_whole_budget_is_invalid_not_exhausted(
    budget_client: ChatClient,
) -> None:
    chat = await budget_client.create_chat()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(budget_client.send(chat.chat_id, "big", options=opts(BUDGET + 1)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_keyed_send_refused_after_its_claim_and_retried_after_the_reset_is_charged_in_the_new_window(
    budget_client: ChatClient,
) -> None:
    chats = [(await budget_client.create_chat()).chat_id for _ in range(2)]
    await start_of_a_window()
    await collect(budget_client.send(chats[0], "hello", options=opts(150)))
    # Claimed (its run id made now), then refused: the budget is spent.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(budget_client.send(chats[1], "again", options=opts(150), idempotency_key="k1"))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    delay = retry_after_s(caught.value)
    assert delay is not None

    # Retried with its key once the window reset, as its RetryInfo says: charged in this window.
    await asyncio.sleep(delay + 0.2)
    retried = await collect(budget_client.send(chats[1], "again", options=opts(150), idempotency_key="k1"))
    assert retried[-1].HasField("done")
    charged = retried[-2].usage.prompt_tokens + retried[-2].usage.completion_tokens
    assert (await usage(budget_client)).used_tokens == charged
