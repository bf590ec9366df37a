"""A retried send that lands on another replica while its first attempt is still starting the run
(placement may take up to ``placement_timeout_s``): the retry joins that run, it is generated once."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Callable

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from memory_store import MemoryStore
from memory_store.models import Message, Role
from orchestrator.runs.chat_run import _fingerprint
from tests.fixtures.orchestrator import ChatClient, Mesh, MeshFactory, answer_text, collect, read_until


async def test_a_retry_on_another_replica_during_a_slow_placement_joins_the_run_and_it_runs_once(
    start_mesh: MeshFactory, connect: Callable[..., ChatClient]
) -> None:
    # A mesh of its own: its router is paused below, so every placement waits. Its engine's load reports
    # may pause that long without the engine being taken for dead (50 intervals: 15 s).
    mesh = start_mesh(
        1, "null", engine_flags={"null_tokens_per_s": 200}, router_flags={"load_interval_ms": 300}
    )
    first_replica, other_replica = mesh.orchestrator, mesh.start_orchestrator()
    on_first = connect(first_replica.address)
    on_other = connect(other_replica.address, on_first.user)
    chat = await on_first.create_chat()
    key = f"key-{uuid.uuid4().hex}"
    options = chat_pb2.GenerationOptions(max_tokens=1000)  # 5 s of answer

    def send(client: ChatClient) -> asyncio.Future[list[chat_pb2.RunEvent]]:
        call = client.send(chat.chat_id, "Tell me a story.", options=options, idempotency_key=key)
        return asyncio.ensure_future(collect(call))

    mesh.launcher.signal(mesh.router_name, signal.SIGSTOP)
    try:
        first = send(on_first)
        await asyncio.sleep(1.0)  # the first attempt has claimed the key and waits for placement
        retry = send(on_other)
        await asyncio.sleep(7.0)  # longer than a retry used to wait for the first attempt's run (5 s)
    finally:
        mesh.launcher.signal(mesh.router_name, signal.SIGCONT)
    # Generated once: the engine never holds two requests for it.
    most = 0
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        most = max(most, mesh.engine_requests())
        await asyncio.sleep(0.1)
    assert most == 1
    runs = await asyncio.wait_for(asyncio.gather(first, retry), 60)
    assert runs[0][0].started.run_id == runs[1][0].started.run_id
    assert answer_text(runs[0]) == answer_text(runs[1]) and runs[0][-1].HasField("done")
    page = await on_first.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert [m.role for m in reversed(page.messages)] == [chat_pb2.ROLE_USER, chat_pb2.ROLE_ASSISTANT]
    assert page.messages[0].content == answer_text(runs[0])


async def claims_made(mesh: Mesh) -> float:
    """The idempotency claims the shared mesh's orchestrator has sent to Cassandra so far."""
    return await mesh.orchestrator.counted(
        "db_client_operation_duration_seconds", "_count", db_operation_name="claim"
    )


async def test_a_send_without_a_key_claims_nothing_and_one_with_a_key_claims_it(
    mesh: Mesh, client: ChatClient
) -> None:
    chat = await client.create_chat()
    short = chat_pb2.GenerationOptions(max_tokens=4)
    before = await claims_made(mesh)
    # Nothing can retry a send without a key: its ids are its own, and no Paxos round claims them.
    first = await collect(client.send(chat.chat_id, "Hello", options=short))
    second = await collect(client.send(chat.chat_id, "Hello", options=short))
    assert first[-1].HasField("done") and second[-1].HasField("done")
    assert first[0].started.run_id != second[0].started.run_id
    assert await claims_made(mesh) == before
    keyed = await collect(
        client.send(chat.chat_id, "Hello", options=short, idempotency_key=f"k-{uuid.uuid4()}")
    )
    assert keyed[-1].HasField("done") and await claims_made(mesh) == before + 1
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert len(page.messages) == 6


async def test_a_refused_send_can_be_retried_with_its_key_at_once(client: ChatClient) -> None:
    # A free user has two run slots: two long answers hold them, so a third send is refused after
    # it claimed its key.
    free = client.as_user(client.user, tier="free")
    chat = await free.create_chat()
    long = chat_pb2.GenerationOptions(max_tokens=2000)
    holders = [free.send(chat.chat_id, "Tell me a story.", options=long) for _ in range(2)]
    runs = [(await anext(aiter(call))).event.started.run_id for call in holders]
    key = f"key-{uuid.uuid4().hex}"
    short = chat_pb2.GenerationOptions(max_tokens=4)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(free.send(chat.chat_id, "And a short one.", options=short, idempotency_key=key))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for run_id in runs:
        await free.call("CancelRun", chat_pb2.CancelRunRequest(run_id=run_id))
    # The refused attempt left nothing holding the key: the retry starts its answer at once.
    started = time.monotonic()
    again = await collect(free.send(chat.chat_id, "And a short one.", options=short, idempotency_key=key))
    assert again[-1].HasField("done") and time.monotonic() - started < 5


async def test_a_send_lost_between_storing_its_message_and_its_run_is_answered_by_its_retry(
    client: ChatClient, memory_store: MemoryStore
) -> None:
    """What the chaos suite's orchestrator kill found: a retry found the lost attempt's own message as
    the chat's newest and refused itself (FAILED_PRECONDITION)."""
    chat = await client.create_chat()
    request = chat_pb2.SendMessageRequest(
        chat_id=chat.chat_id, content="Hello again?", idempotency_key=f"key-{uuid.uuid4().hex}"
    )
    # What the lost attempt did: claimed the key (its start lease long over) and stored its message.
    claim = await memory_store.claim_idempotency_key(
        client.user, request.idempotency_key, _fingerprint("send", request), 0.0
    )
    await memory_store.append_message(
        client.user,
        Message(
            message_id=claim.user_message_id,
            chat_id=chat.chat_id,
            role=Role.USER,
            content=request.content,
            parent_id=None,
            token_count=3,
            run_id=claim.run_id,
        ),
    )
    events = await collect(client.stream("SendMessage", request))
    assert events[0].started.run_id == claim.run_id and events[-1].HasField("done")
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert [(m.role, m.message_id) for m in reversed(page.messages)] == [
        (chat_pb2.ROLE_USER, claim.user_message_id),
        (chat_pb2.ROLE_ASSISTANT, claim.assistant_message_id),
    ]


async def test_a_send_refused_after_storing_its_question_is_answered_by_its_retry_once(
    start_mesh: MeshFactory, connect: Callable[..., ChatClient], memory_store: MemoryStore
) -> None:
    """The engine's queue limit refuses a send that waited past its tier's objective, after its question
    and run were stored. The retry with its key answers that same question (a new run: the refused one
    keeps its events), so the question is stored once; the refused run is charged nothing."""
    # One engine running one request at a time: a 60-token answer at 20 tokens/s holds it 3 s, past the
    # pro tier's 1 s objective for whatever queues behind it.
    mesh = start_mesh(1, "null", engine_flags={"null_tokens_per_s": 20, "max_running_requests": 1})
    holder, asker = connect(mesh.orchestrator.address), connect(mesh.orchestrator.address)
    long = chat_pb2.GenerationOptions(max_tokens=60)
    holding = holder.send((await holder.create_chat()).chat_id, "Hold it.", options=long)
    await read_until(holding, 2)  # its first delta: it runs
    chat = await asker.create_chat()
    key = f"key-{uuid.uuid4().hex}"
    short = chat_pb2.GenerationOptions(max_tokens=4)
    refused = await collect(asker.send(chat.chat_id, "Anyone there?", options=short, idempotency_key=key))
    assert refused[0].HasField("started") and refused[-1].HasField("error"), refused
    assert not any(event.HasField("delta") for event in refused)
    assert refused[-1].error.code == "RESOURCE_EXHAUSTED" and refused[-1].error.retry_after_ms > 0
    first = refused[0].started
    await collect(holding)

    again = await collect(asker.send(chat.chat_id, "Anyone there?", options=short, idempotency_key=key))
    assert again[-1].HasField("done"), again
    second = again[0].started
    assert second.user_message_id == first.user_message_id
    assert second.run_id != first.run_id and second.assistant_message_id != first.assistant_message_id
    page = await asker.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert [(m.role, m.message_id) for m in reversed(page.messages)] == [
        (chat_pb2.ROLE_USER, first.user_message_id),
        (chat_pb2.ROLE_ASSISTANT, second.assistant_message_id),
    ]
    # The refused run keeps its own end, charged nothing; a later retry joins the answered run.
    old = await memory_store.get_run(asker.user, first.run_id)
    assert old.error_code == "RESOURCE_EXHAUSTED" and old.usage is not None and old.usage.total_tokens == 0
    third = await collect(asker.send(chat.chat_id, "Anyone there?", options=short, idempotency_key=key))
    assert third[0].started.run_id == second.run_id and answer_text(third) == answer_text(again)
