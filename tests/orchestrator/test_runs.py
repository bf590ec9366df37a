"""Runs through real processes: a dropped client does not stop an answer, streams resume from any
sequence number (live, finished, and on another replica), cancel stops at once, retries join."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from tests.fixtures.cassandra import CassandraTestNode
from tests.fixtures.orchestrator import (
    ChatClient,
    Mesh,
    MeshFactory,
    OrchestratorProcess,
    answer_text,
    collect,
    kinds,
    new_user,
    read_until,
)

pytestmark = pytest.mark.usefixtures("router_required")


@pytest.fixture(scope="module")
def replica_b(mesh: Mesh) -> Iterator[OrchestratorProcess]:
    """A second replica over the same Cassandra and router: it never holds the shared mesh's runs."""
    with mesh.replica() as replica:
        yield replica


def long_send(
    client: ChatClient, chat_id: str, max_tokens: int, **fields: object
) -> grpc.aio.UnaryStreamCall:
    return client.send(
        chat_id, "Tell me a long story.", options=chat_pb2.GenerationOptions(max_tokens=max_tokens), **fields
    )


async def wait_for_status(
    client: ChatClient, run_id: str, status: int, timeout_s: float = 30.0
) -> chat_pb2.Run:
    deadline = time.monotonic() + timeout_s
    while True:
        run = (await client.call("GetRun", chat_pb2.GetRunRequest(run_id=run_id))).run
        if run.status == status:
            return run
        assert time.monotonic() < deadline, f"run {run_id} is still {chat_pb2.RunStatus.Name(run.status)}"
        await asyncio.sleep(0.1)


async def chat_messages(client: ChatClient, chat_id: str) -> list[chat_pb2.Message]:
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat_id, page_size=200))
    return list(reversed(page.messages))


async def test_a_client_that_drops_mid_stream_does_not_stop_the_answer_and_it_is_stored_once(
    client: ChatClient,
) -> None:
    chat = await client.create_chat()
    call = long_send(client, chat.chat_id, 200)
    seen = await read_until(call, 5)
    call.cancel()  # the browser went away
    run_id = seen[0].started.run_id

    run = await wait_for_status(client, run_id, chat_pb2.RUN_STATUS_COMPLETED)
    stored = await chat_messages(client, chat.chat_id)
    assert [m.role for m in stored] == [chat_pb2.ROLE_USER, chat_pb2.ROLE_ASSISTANT]
    answer = stored[1]
    assert answer.usage.completion_tokens == 200 and answer.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    assert answer.content.startswith(answer_text(seen))
    replay = await collect(client.stream_run(run_id))
    assert answer_text(replay) == answer.content and replay[-1].seq == run.last_seq


async def test_stream_run_resumes_from_any_seq_with_no_gap_or_duplicate_live_and_after_the_end(
    client: ChatClient, replica_b: OrchestratorProcess, connect: Callable[..., ChatClient]
) -> None:
    chat = await client.create_chat()
    call = long_send(client, chat.chat_id, 120)
    head = await read_until(call, 4)
    run_id = head[0].started.run_id
    resume_points = (0, 1, 3, 4)
    # Attached while the run generates (on its replica), from several points.
    live = [asyncio.create_task(collect(client.stream_run(run_id, after))) for after in resume_points]
    reference = head + await collect(call)
    assert [e.seq for e in reference] == list(range(1, len(reference) + 1))
    for after, got in zip(resume_points, await asyncio.gather(*live), strict=True):
        assert got == reference[after:]

    # After the end: from memory on the same replica, and rebuilt from Cassandra on another one.
    other = connect(replica_b.address, client.user)
    for after in (0, 2, len(reference) - 3, len(reference) - 1, len(reference)):
        assert await collect(client.stream_run(run_id, after)) == reference[after:]
        assert await collect(other.stream_run(run_id, after)) == reference[after:]


async def test_a_stored_runs_logprobs_stream_with_its_tokens_and_every_resumed_stream_gets_them_again(
    client: ChatClient, replica_b: OrchestratorProcess, connect: Callable[..., ChatClient]
) -> None:
    chat = await client.create_chat()
    options = chat_pb2.GenerationOptions(max_tokens=60, logprobs=True, top_logprobs=2)
    call = client.send(chat.chat_id, "Tell me a long story.", options=options)
    head = await read_until(call, 10)
    call.cancel()  # the client drops mid-answer, and resumes where it was
    run_id = head[0].started.run_id
    reference = head + await collect(client.stream_run(run_id, 10))
    assert [e.seq for e in reference] == list(range(1, len(reference) + 1))
    deltas = [e.delta for e in reference if e.HasField("delta")]
    # Every token's logprob rides on the delta that carries the token, with its two alternatives.
    assert all(len(delta.logprobs) == delta.token_count for delta in deltas)
    assert sum(len(delta.logprobs) for delta in deltas) == options.max_tokens
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for delta in deltas for lp in delta.logprobs)

    # From memory on its replica, and rebuilt from Cassandra on another one: the same numbers.
    other = connect(replica_b.address, client.user)
    for after in (0, 5, 10, len(reference) - 3):
        assert await collect(client.stream_run(run_id, after)) == reference[after:]
        assert await collect(other.stream_run(run_id, after)) == reference[after:]

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        too_many = chat_pb2.GenerationOptions(max_tokens=4, logprobs=True, top_logprobs=21)
        await collect(client.send(chat.chat_id, "And now?", options=too_many))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_logprobs" in (refused.value.details() or "")


async def test_another_replica_follows_a_run_in_progress_from_its_checkpoints(
    client: ChatClient, replica_b: OrchestratorProcess, connect: Callable[..., ChatClient]
) -> None:
    chat = await client.create_chat()
    call = long_send(client, chat.chat_id, 150)
    head = await read_until(call, 2)
    other = connect(replica_b.address, client.user)
    followed = asyncio.create_task(collect(other.stream_run(head[0].started.run_id, 1)))
    reference = head + await collect(call)
    assert await followed == reference[1:]


def assert_merged_from(reference: list[chat_pb2.RunEvent], got: list[chat_pb2.RunEvent], after: int) -> None:
    """``got`` is ``reference`` (one event per sequence number) after ``after``, with runs of deltas
    merged: each delta of ``got`` is the deltas since the event before it, joined, numbered as the last."""
    assert got and got[-1] == reference[-1]
    previous = after
    for event in got:
        assert event.seq > previous
        if event.WhichOneof("kind") != "delta":
            assert event == reference[event.seq - 1] and event.seq == previous + 1
        else:
            covered = reference[previous : event.seq]
            assert kinds(covered) == ["delta"] * len(covered)
            assert event.delta.text == answer_text(covered)
            assert event.delta.token_count == sum(e.delta.token_count for e in covered)
        previous = event.seq


async def test_streams_that_ask_for_merged_deltas_get_the_waiting_ones_as_one_and_resume_exactly(
    client: ChatClient, replica_b: OrchestratorProcess, connect: Callable[..., ChatClient]
) -> None:
    chat = await client.create_chat()
    key = f"key-{uuid.uuid4().hex}"
    call = long_send(client, chat.chat_id, 80, idempotency_key=key, merge_deltas=True)
    head = await read_until(call, 8)
    run_id = head[0].started.run_id
    # Attached late, while the run generates: what was made so far comes as one delta.
    late = client.stream(
        "StreamRun", chat_pb2.StreamRunRequest(run_id=run_id, after_seq=1, merge_deltas=True)
    )
    late_head = await read_until(late, 2)
    assert len(late_head) == 1 and late_head[0].delta.token_count >= 7
    # A retry that asks otherwise is the same request: it joins the run and gets one event per seq.
    joined = await collect(long_send(client, chat.chat_id, 80, idempotency_key=key))
    assert joined[0].started.run_id == run_id
    assert [e.seq for e in joined] == list(range(1, len(joined) + 1))
    assert_merged_from(joined, head + await collect(call), 0)
    assert_merged_from(joined, late_head + await collect(late), 1)
    # After the end, from memory and rebuilt from Cassandra on another replica.
    other = connect(replica_b.address, client.user)
    for reader in (client, other):
        for after in (0, 1, 5, len(joined) - 3):
            request = chat_pb2.StreamRunRequest(run_id=run_id, after_seq=after, merge_deltas=True)
            got = await collect(reader.stream("StreamRun", request))
            assert_merged_from(joined, got, after)
            assert kinds(got).count("delta") == 1


@pytest.mark.usefixtures("engines_idle")
async def test_cancel_stops_the_run_at_once_frees_the_engine_and_keeps_what_was_said(
    client: ChatClient, mesh: Mesh
) -> None:
    chat = await client.create_chat()
    call = long_send(client, chat.chat_id, 3000)
    head = await read_until(call, 6)
    run_id = head[0].started.run_id

    cancelled = (await client.call("CancelRun", chat_pb2.CancelRunRequest(run_id=run_id))).run
    assert cancelled.status == chat_pb2.RUN_STATUS_CANCELLED
    rest = await asyncio.wait_for(collect(call), 10)
    run = head + rest
    assert kinds(run)[-2:] == ["usage", "done"]
    assert run[-1].done.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    assert run[-2].usage.completion_tokens < 3000
    assert mesh.engine_requests() == 0

    answer = (await chat_messages(client, chat.chat_id))[-1]
    assert answer.content == answer_text(run) and answer.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    # Cancelling a finished run changes nothing.
    again = (await client.call("CancelRun", chat_pb2.CancelRunRequest(run_id=run_id))).run
    assert again.status == chat_pb2.RUN_STATUS_CANCELLED and again.last_seq == run[-1].seq


async def test_a_cancel_frees_the_engine_and_answers_in_time_while_cassandra_answers_nothing(
    client: ChatClient, mesh: Mesh, cassandra_node: CassandraTestNode
) -> None:
    chat = await client.create_chat()
    call = long_send(client, chat.chat_id, 3000)
    head = await read_until(call, 6)
    run_id = head[0].started.run_id
    cancel = chat_pb2.CancelRunRequest(run_id=run_id)

    with cassandra_node.paused():
        # Nothing the cancel reads (the chat, to tell a deleted one's run) is answered, nor can its end
        # be stored: it is answered CANCELLING within the caller's deadline, the run stopped already.
        asked = time.monotonic()
        answered = (await client.stub.CancelRun(cancel, metadata=client.metadata(), timeout=2.0)).run
        assert time.monotonic() - asked < 2.0
        assert answered.status == chat_pb2.RUN_STATUS_CANCELLING
        assert await asyncio.to_thread(mesh.engine_requests) == 0

    # Once the node answers again, the end is stored: the stream ends cancelled, with the answer.
    run = head + await asyncio.wait_for(collect(call), 60)
    assert kinds(run)[-2:] == ["usage", "done"]
    assert run[-1].done.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    assert run[-2].usage.completion_tokens < 3000
    assert [event.seq for event in run if event.HasField("delta")][-1] <= answered.last_seq  # none after it
    answer = (await chat_messages(client, chat.chat_id))[-1]
    assert answer.content == answer_text(run) and answer.finish_reason == chat_pb2.FINISH_REASON_CANCELLED


async def test_a_cancel_whose_end_outlasts_the_callers_deadline_answers_cancelling_in_time(
    start_mesh: MeshFactory, connect: Callable[..., ChatClient]
) -> None:
    # A mesh of its own: its router is paused below, which holds the run's end (the relay waits for
    # the router to confirm the cancel). Its engine's load reports may pause that long.
    mesh = start_mesh(
        1, "null", engine_flags={"null_tokens_per_s": 200}, router_flags={"load_interval_ms": 300}
    )
    client = connect(mesh.orchestrator.address)
    chat = await client.create_chat()
    call = long_send(client, chat.chat_id, 3000)
    head = await read_until(call, 6)
    run_id = head[0].started.run_id
    cancel = chat_pb2.CancelRunRequest(run_id=run_id)

    mesh.launcher.signal(mesh.router_name, signal.SIGSTOP)
    try:
        asked = time.monotonic()
        answered = (await client.stub.CancelRun(cancel, metadata=client.metadata(), timeout=3.0)).run
        assert time.monotonic() - asked < 3.0
        assert answered.status == chat_pb2.RUN_STATUS_CANCELLING
        got = (await client.call("GetRun", chat_pb2.GetRunRequest(run_id=run_id))).run
        assert got.status == chat_pb2.RUN_STATUS_CANCELLING and got.last_seq == answered.last_seq
    finally:
        mesh.launcher.signal(mesh.router_name, signal.SIGCONT)

    rest = await asyncio.wait_for(collect(call), 30)
    run = head + rest
    assert kinds(run)[-2:] == ["usage", "done"]
    assert run[-1].done.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    assert [event.seq for event in run if event.HasField("delta")][-1] <= answered.last_seq  # none after it
    ended = await wait_for_status(client, run_id, chat_pb2.RUN_STATUS_CANCELLED)
    assert ended.last_seq == run[-1].seq
    answer = (await chat_messages(client, chat.chat_id))[-1]
    assert answer.content == answer_text(run) and answer.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    assert mesh.engine_requests() == 0


@pytest.mark.usefixtures("engines_idle")
async def test_deleting_a_chat_stops_its_running_answer_and_frees_the_engine(
    client: ChatClient, mesh: Mesh
) -> None:
    chat = await client.create_chat()
    call = long_send(client, chat.chat_id, 3000)
    head = await read_until(call, 6)
    run_id = head[0].started.run_id

    await client.call("DeleteChat", chat_pb2.DeleteChatRequest(chat_id=chat.chat_id))
    rest = await asyncio.wait_for(collect(call), 10)
    assert rest[-1].done.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    assert mesh.engine_requests() == 0  # the router confirmed the cancel before the end was stored
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await client.call("GetRun", chat_pb2.GetRunRequest(run_id=run_id))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_cancel_reaching_another_replica_stops_the_owner(
    client: ChatClient, replica_b: OrchestratorProcess, connect: Callable[..., ChatClient]
) -> None:
    chat = await client.create_chat()
    call = long_send(client, chat.chat_id, 3000)
    head = await read_until(call, 3)
    other = connect(replica_b.address, client.user)
    cancelled = await other.call("CancelRun", chat_pb2.CancelRunRequest(run_id=head[0].started.run_id))
    assert cancelled.run.status == chat_pb2.RUN_STATUS_CANCELLED
    rest = await asyncio.wait_for(collect(call), 15)
    assert rest[-1].done.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    assert (head + rest)[-2].usage.completion_tokens < 3000
    # Stored: everything streamed before the cancel arrived (the owner may stream a little more
    # until it learns of the cancel, a couple of seconds later).
    answer = (await chat_messages(client, chat.chat_id))[-1]
    assert answer.role == chat_pb2.ROLE_ASSISTANT
    assert answer.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    assert answer.content.startswith(answer_text(head))
    assert answer_text(head + rest).startswith(answer.content)


async def test_twenty_concurrent_retries_of_one_send_store_one_question_and_one_answer(
    client: ChatClient,
) -> None:
    chat = await client.create_chat()
    key = f"key-{uuid.uuid4().hex}"
    runs = await asyncio.gather(
        *(collect(long_send(client, chat.chat_id, 30, idempotency_key=key)) for _ in range(20))
    )
    run_ids = {run[0].started.run_id for run in runs}
    assert len(run_ids) == 1
    assert all(run == runs[0] for run in runs)
    # A retry after the end joins the same run too.
    again = await collect(long_send(client, chat.chat_id, 30, idempotency_key=key))
    assert again == runs[0]
    stored = await chat_messages(client, chat.chat_id)
    assert [m.role for m in stored] == [chat_pb2.ROLE_USER, chat_pb2.ROLE_ASSISTANT]


async def test_an_idempotency_key_reused_for_another_message_is_refused(client: ChatClient) -> None:
    chat = await client.create_chat()
    key = f"key-{uuid.uuid4().hex}"
    await collect(long_send(client, chat.chat_id, 4, idempotency_key=key))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(client.send(chat.chat_id, "something else", idempotency_key=key))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_the_chat_names_its_active_run_while_it_generates(client: ChatClient) -> None:
    chat = await client.create_chat()
    call = long_send(client, chat.chat_id, 100)
    head = await read_until(call, 2)
    during = (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat
    assert during.active_run_id == head[0].started.run_id
    await collect(call)
    after = (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat
    assert after.active_run_id == ""


async def test_another_users_run_is_not_found(client: ChatClient) -> None:
    chat = await client.create_chat()
    run = await collect(long_send(client, chat.chat_id, 4))
    run_id = run[0].started.run_id
    intruder = client.as_user(new_user())
    for method, request in [
        ("GetRun", chat_pb2.GetRunRequest(run_id=run_id)),
        ("CancelRun", chat_pb2.CancelRunRequest(run_id=run_id)),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await intruder.call(method, request)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, method
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(intruder.stream_run(run_id))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    regenerate = chat_pb2.RegenerateMessageRequest(
        chat_id=chat.chat_id, message_id=run[-1].done.assistant_message_id
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(intruder.stream("RegenerateMessage", regenerate))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
