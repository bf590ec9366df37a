"""A run on its way to going live, with the race held open by a seam inside the replica: a replica in
this process (tests/fixtures/in_process.py, wired as the server wires it) over the real Cassandra node and
the shared mesh's router and null engines, whose store (or router) holds a named call until the test lets
it go."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError
from chatmesh.finish import Usage
from chatmesh.identity import Identity
from chatmesh.limits import Generation
from memory_store.errors import Unavailable
from memory_store.models import Message, NewRun, Role, RunStatus
from memory_store.store import MemoryStore
from orchestrator.router_client import start_frame
from orchestrator.runs.complete import CompleteRun
from orchestrator.runs.replay import INTERRUPTED_CODE
from orchestrator.runs.send import SendRun
from tests.fixtures.answers import ANSWER
from tests.fixtures.in_process import At, InProcessReplica, in_process_replica
from tests.fixtures.orchestrator import Mesh

pytestmark = pytest.mark.usefixtures("router_required")


def send(key: str, chat_id: str, content: str, max_tokens: int = 8) -> chat_pb2.SendMessageRequest:
    return chat_pb2.SendMessageRequest(
        chat_id=chat_id,
        content=content,
        idempotency_key=key,
        options=chat_pb2.GenerationOptions(max_tokens=max_tokens),
    )


async def to_the_end(events) -> list[chat_pb2.RunEvent]:
    return [event async for event in events]


@pytest.fixture
async def replica(memory_store: MemoryStore, mesh: Mesh) -> AsyncIterator[InProcessReplica]:
    """A replica in this process (of a group of its own), whose store and router hold (or fail) what
    the test asks them to."""
    async with in_process_replica(memory_store, mesh.router_address) as replica:
        yield replica


def someone() -> Identity:
    return Identity(f"user-{uuid.uuid4().hex[:12]}", "pro")


async def test_a_different_request_with_the_key_of_a_run_still_starting_is_refused(
    memory_store: MemoryStore, replica: InProcessReplica
) -> None:
    store, ctx = replica.store, replica.parts.ctx
    me = someone()
    chat = await memory_store.create_chat(me.user_id)
    key = uuid.uuid4().hex
    claiming = store.hold("claim_idempotency_key")
    first = SendRun(ctx, me, send(key, chat.chat_id, "the first question"))
    starting = asyncio.create_task(ctx.runs.starts.start(first))
    await claiming.reached.wait()  # the first is starting: its claim is on its way

    other = SendRun(ctx, me, send(key, chat.chat_id, "another question"))
    with pytest.raises(ServiceError) as refused:
        # A join would wait for the first (held): the timeout only bounds that failure.
        await asyncio.wait_for(ctx.runs.starts.start(other), 5.0)
    assert refused.value.code is grpc.StatusCode.ALREADY_EXISTS

    claiming.release()
    run_id = await starting
    assert first.live is not None and first.live.info.run_id == run_id
    await to_the_end(first.live.follow(0))
    stored = await memory_store.get_run(me.user_id, run_id)
    assert stored.status is RunStatus.COMPLETED


async def test_a_caller_who_leaves_while_its_reservation_is_on_its_way_is_not_charged(
    memory_store: MemoryStore, replica: InProcessReplica
) -> None:
    store, ctx = replica.store, replica.parts.ctx
    me = someone()
    reserving = store.hold("record_usage", At.SENT)  # the write lands, its answer is late
    request = chat_pb2.CompleteRequest(
        messages=[chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content="hello")],
        options=chat_pb2.GenerationOptions(max_tokens=64),
    )
    caller = asyncio.create_task(ctx.runs.starts.start(CompleteRun(ctx, me, request)))
    await reserving.reached.wait()
    store.clear("record_usage")  # the next writes (the release) are not held
    caller.cancel()  # a Complete's caller leaves: its run is abandoned during placement
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert reserving.call is not None
    await reserving.call  # the reservation (prompt + 64) landed
    reserving.release()
    await ctx.runs.drain.shutdown(5.0)  # the run's task has ended (its undoing included)
    window = await memory_store.get_usage(me.user_id)
    assert (window.runs, window.usage) == (1, Usage())


async def test_a_cancel_while_an_adopted_run_is_placed_again_stops_it(
    memory_store: MemoryStore, replica: InProcessReplica
) -> None:
    ctx = replica.parts.ctx
    # A run of a replica that died before its first checkpoint, stored as a send stores it.
    user = f"user-{uuid.uuid4().hex[:12]}"
    chat = await memory_store.create_chat(user)
    claim = await memory_store.claim_idempotency_key(user, uuid.uuid4().hex, b"fingerprint")
    asked = Message(claim.user_message_id, chat.chat_id, Role.USER, "tell me a story")
    model = ctx.models.get("")
    prompt = model.tokenizer.encode("tell me a story")
    options = Generation(model.name, 400, temperature=0.7, top_p=1.0, seed=None, stop=())
    generation = start_frame(claim.run_id, prompt, options, "pro", chat.chat_id, model.tokenizer.fingerprint)
    orphan = await memory_store.create_run_with_question(
        NewRun(
            user,
            chat.chat_id,
            run_id=claim.run_id,
            parent_message_id=asked.message_id,
            assistant_message_id=claim.assistant_message_id,
            model=model.name,
            owner_id=f"dead-{uuid.uuid4().hex[:6]}",
            user_message_id=asked.message_id,
            prompt_tokens=len(prompt),
            generation=generation.SerializeToString(),
        ),
        asked,
        chat,
    )
    placing = replica.router.hold("place")
    assert await ctx.runs.adoptions.adopt(orphan, ctx.config.replica_id)
    await placing.reached.wait()  # adopted, and being placed again

    answered = await ctx.runs.cancels.cancel(user, claim.run_id, 2.0)
    assert answered.status in (chat_pb2.RUN_STATUS_CANCELLING, chat_pb2.RUN_STATUS_CANCELLED)
    placing.release()
    events = await to_the_end(ctx.runs.reads.stream(user, claim.run_id, 0))
    assert events[-1].HasField("done") and events[-1].done.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    stored = await memory_store.get_run(user, claim.run_id)
    assert stored.status is RunStatus.CANCELLED


async def test_streams_of_an_adopted_run_no_router_places_again_are_told_to_resume(
    memory_store: MemoryStore, replica: InProcessReplica
) -> None:
    """The replica lets go of an adopted run it cannot place again (it is ended as interrupted in
    Cassandra): a stream that followed it meanwhile is told to resume, not left waiting, and resuming
    gets its end."""
    ctx = replica.parts.ctx
    user = f"user-{uuid.uuid4().hex[:12]}"
    chat = await memory_store.create_chat(user)
    orphan = await replica.orphan(memory_store, user, chat.chat_id, "tell me a story", ANSWER)
    placing = replica.router.hold("place")
    assert await ctx.runs.adoptions.adopt(orphan, ctx.config.replica_id)
    await placing.reached.wait()  # adopted, and being placed again
    following = ctx.runs.reads.stream(user, orphan.run_id, 0)
    assert (await anext(following)).HasField("started")

    replica.router.fail("place")
    placing.release()
    with pytest.raises(ServiceError) as told:
        await asyncio.wait_for(anext(following), 10.0)
    assert told.value.code is grpc.StatusCode.UNAVAILABLE and "resume after event 1" in told.value.message
    replica.router.clear("place")
    resumed = await asyncio.wait_for(to_the_end(ctx.runs.reads.stream(user, orphan.run_id, 1)), 10.0)
    assert [event.WhichOneof("kind") for event in resumed] == ["error"]
    assert resumed[0].seq == 2 and resumed[0].error.code == INTERRUPTED_CODE
    assert (await memory_store.get_run(user, orphan.run_id)).status is RunStatus.INTERRUPTED


async def test_a_keyless_send_whose_question_landed_without_its_run_is_asked_once_by_its_retry(
    memory_store: MemoryStore, replica: InProcessReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = replica.parts.ctx
    me = someone()
    chat = await memory_store.create_chat(me.user_id)
    request = send("", chat.chat_id, "What is the capital of France?")
    db = replica.store._db

    async def question_only(first, then, max_batch_bytes: int) -> None:
        # The ordered fallback's first write (the question) lands; the run's times out.
        await db.write(first, max_batch_bytes)
        raise Unavailable("the run's write timed out")

    with monkeypatch.context() as patched:
        patched.setattr(db, "write_in_order", question_only)
        with pytest.raises(Unavailable):
            await ctx.runs.starts.start(SendRun(ctx, me, request))

    retry = SendRun(ctx, me, request)
    await ctx.runs.starts.start(retry)
    assert retry.live is not None
    await to_the_end(retry.live.follow(0))
    # One question, answered by the retry's run.
    page = await memory_store.list_messages(me.user_id, chat.chat_id)
    messages = list(reversed(page.items))
    assert [m.role for m in messages] == [Role.USER, Role.ASSISTANT]
    asked, answer = messages
    assert (asked.role, asked.content, answer.role) == (Role.USER, request.content, Role.ASSISTANT)
    assert (answer.parent_id, answer.message_id) == (asked.message_id, retry.live.info.assistant_message_id)
