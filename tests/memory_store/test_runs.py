"""Runs on a real Cassandra node: idempotent sends, checkpoints, exactly-once answers, orphans, usage."""

import asyncio
import dataclasses
from datetime import timedelta
from uuid import uuid1

import pytest
from cassandra.query import SimpleStatement
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from chatmesh.finish import FinishReason, Usage
from memory_store import db
from memory_store.base import now
from memory_store.errors import FailedPrecondition, InvalidArgument, NotFound, OwnerChanged, Unavailable
from memory_store.models import MessageStatus, NewRun, Role, RunDelta, RunOutcome, RunStatus
from memory_store.store import MemoryStore
from tests.memory_store.builders import (
    checkpoint,
    message,
    new_user,
    operations_counted,
    requests_sent,
    start_run,
)


def deltas(first_seq, *texts):
    return [RunDelta(first_seq + i, text, 1) for i, text in enumerate(texts)]


def new_run(user, chat, claim, asked, **fields):
    """The run a claim reserved, answering ``asked``."""
    return NewRun(
        user,
        chat.chat_id,
        run_id=claim.run_id,
        parent_message_id=asked.message_id,
        assistant_message_id=claim.assistant_message_id,
        model="smollm2-135m",
        owner_id="replica-a",
        user_message_id=asked.message_id,
        **fields,
    )


async def test_fifty_concurrent_sends_with_one_key_store_one_message_and_one_run(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "double clicks")

    async def send():
        claim = await memory_store.claim_idempotency_key(user, "send-1", b"same request")
        asked = await memory_store.append_message(
            user, message(chat.chat_id, "only once please", message_id=claim.user_message_id)
        )
        await memory_store.create_run(new_run(user, chat, claim, asked))
        return claim

    claims = await asyncio.gather(*(send() for _ in range(50)))

    assert len({(c.run_id, c.user_message_id, c.assistant_message_id) for c in claims}) == 1
    assert sum(c.created for c in claims) == 1
    assert all(c.fingerprint_matches for c in claims)
    stored = (await memory_store.list_messages(user, chat.chat_id)).items
    assert [m.message_id for m in stored] == [claims[0].user_message_id]
    assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id == claims[0].run_id
    assert (await memory_store.get_run(user, claims[0].run_id)).status is RunStatus.IN_PROGRESS


async def test_reused_key_with_another_request_is_reported(memory_store):
    user, other_user = new_user(), new_user()
    first = await memory_store.claim_idempotency_key(user, "k", b"request A")
    again = await memory_store.claim_idempotency_key(user, "k", b"request A")
    different = await memory_store.claim_idempotency_key(user, "k", b"request B")
    someone_else = await memory_store.claim_idempotency_key(other_user, "k", b"request A")

    assert (first.created, again.created, again.fingerprint_matches) == (True, False, True)
    assert again.run_id == first.run_id == different.run_id
    assert not different.fingerprint_matches
    assert someone_else.created and someone_else.run_id != first.run_id
    with pytest.raises(InvalidArgument, match="idempotency key"):
        await memory_store.claim_idempotency_key(user, "k" * 129, b"x")


async def test_only_one_attempt_at_a_time_holds_a_keys_start_lease(memory_store):
    user = new_user()
    first = await memory_store.claim_idempotency_key(user, "k", b"request", start_lease_s=30)
    retry = await memory_store.claim_idempotency_key(user, "k", b"request", start_lease_s=30)
    assert first.start_lease is not None and retry.start_lease is None
    # While the first attempt holds it, nobody else may start the run.
    assert await memory_store.take_start_lease(user, "k", 30) is None
    # Refused, it gives the lease up: one retry takes it, and holds it against the others.
    await memory_store.release_start_lease(user, "k", first.start_lease)
    taken = await memory_store.take_start_lease(user, "k", 0.5)
    assert taken is not None
    assert await memory_store.take_start_lease(user, "k", 30) is None
    # A lease whose holder was lost expires; a late release of an old lease takes nothing away.
    await asyncio.sleep(0.6)
    latest = await memory_store.take_start_lease(user, "k", 30)
    assert latest is not None
    await memory_store.release_start_lease(user, "k", taken)
    assert await memory_store.take_start_lease(user, "k", 30) is None


async def test_a_key_leased_late_in_its_life_expires_whole(cassandra_node):
    # Keys live 4 s here. A lease given up (or taken) late in a key's life rewrites its lease cell with a
    # full TTL: once the claim's own cells expire, the key must be free, not another request's.
    store = await MemoryStore.connect(dataclasses.replace(cassandra_node.store_config, idempotency_ttl_s=4))
    try:
        user = new_user()
        first = await store.claim_idempotency_key(user, "k", b"request", start_lease_s=30)
        await asyncio.sleep(2.0)
        await store.release_start_lease(user, "k", first.start_lease)  # refused late in the key's life
        await asyncio.sleep(2.5)  # the claim's cells have expired, the lease's has not
        again = await store.claim_idempotency_key(user, "k", b"another request", start_lease_s=30)
        assert again.created and again.fingerprint_matches and again.start_lease is not None
        assert again.run_id != first.run_id and again.user_message_id != first.user_message_id
        retried = await store.claim_idempotency_key(user, "k", b"another request")
        assert (retried.created, retried.fingerprint_matches, retried.run_id) == (False, True, again.run_id)
    finally:
        await store.close()


async def test_a_keys_run_is_renewed_once_however_many_retries_race(memory_store):
    user = new_user()
    first = await memory_store.claim_idempotency_key(user, "k", b"request", start_lease_s=30)
    await memory_store.release_start_lease(user, "k", first.start_lease)
    renewals = await asyncio.gather(*(memory_store.renew_claim(user, "k", first, 30) for _ in range(5)))
    renewed = [claim for claim in renewals if claim is not None]
    assert len(renewed) == 1
    new = renewed[0]
    assert new.run_id != first.run_id and new.assistant_message_id != first.assistant_message_id
    assert new.user_message_id == first.user_message_id and new.start_lease is not None
    # Every later claim of the key reads the new run, whose lease the renewal holds; a renewal of the
    # old run changes nothing.
    again = await memory_store.claim_idempotency_key(user, "k", b"request", 30)
    assert (again.run_id, again.assistant_message_id) == (new.run_id, new.assistant_message_id)
    assert again.start_lease is None and again.fingerprint_matches
    assert await memory_store.take_start_lease(user, "k", 30) is None
    assert await memory_store.renew_claim(user, "k", first, 30) is None


async def test_a_key_claimed_before_start_leases_existed_can_be_leased_once(memory_store):
    user = new_user()
    claim = await memory_store.claim_idempotency_key(user, "old", b"request")
    # What a claim written by the previous schema looks like: no lease at all.
    await memory_store._db.execute(
        SimpleStatement("DELETE starting_until FROM idempotency_keys WHERE user_id = %s AND key = %s"),
        (user, "old"),
    )
    assert await memory_store.take_start_lease(user, "old", 30) is not None
    assert await memory_store.take_start_lease(user, "old", 30) is None
    again = await memory_store.claim_idempotency_key(user, "old", b"request")
    assert again.run_id == claim.run_id and again.start_lease is None


async def test_checkpointed_output_replays_from_any_sequence_number(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "resume")
    run, _ = await start_run(memory_store, user, chat.chat_id, "tell me a story")
    await checkpoint(memory_store, run, deltas(2, "Once", " upon"))
    await checkpoint(memory_store, run, deltas(4, " a", " time", " 🌙"))
    # A stale retry of the first checkpoint does not move the run back.
    await checkpoint(memory_store, run, deltas(2, "Once", " upon"))

    assert (await memory_store.get_run(user, run.run_id)).last_seq == 6
    for after, expected in [(0, "Once upon a time 🌙"), (3, " a time 🌙"), (6, "")]:
        replay = await memory_store.read_run_output(user, run.run_id, after)
        assert "".join(d.text for d in replay) == expected
        assert [d.seq for d in replay] == list(range(after + 1 if after else 2, 7))
    with pytest.raises(InvalidArgument, match="consecutive"):
        await checkpoint(memory_store, run, [RunDelta(7, "a"), RunDelta(9, "b")])
    with pytest.raises(NotFound):
        await memory_store.read_run_output(new_user(), run.run_id)
    with pytest.raises(NotFound):
        await memory_store.get_run(new_user(), run.run_id)


async def test_tool_steps_are_stored_among_the_output_events_in_order(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "tools")
    run, _ = await start_run(memory_store, user, chat.chat_id, "what is 6 * 7?")
    started = '{"started": {"call_id": "c1", "tool": "calculator", "arguments": "{}"}}'
    result = '{"result": {"call_id": "c1", "tool": "calculator", "outcome": "ok", "text": "42"}}'
    call = RunDelta(2, "<tool_call>", 2, (10, 11))
    await checkpoint(memory_store, run, [call, RunDelta(3, "", 0, (), started)])
    await checkpoint(memory_store, run, [RunDelta(4, "", 0, (), result), RunDelta(5, "It", 1, (12,))])
    assert await memory_store.read_run_output(user, run.run_id) == [
        call,
        RunDelta(3, "", 0, (), started),
        RunDelta(4, "", 0, (), result),
        RunDelta(5, "It", 1, (12,)),
    ]
    # A finish's tail keeps its steps too, and the answer is the text alone.
    outcome = RunOutcome(
        status=RunStatus.COMPLETED,
        last_seq=9,
        finish_reason=FinishReason.STOP,
        tail=(RunDelta(6, "", 0, (), started), RunDelta(7, " is 42", 2, (13, 14))),
        usage=Usage(prompt_tokens=30, completion_tokens=5),
    )
    finished = await memory_store.finish_run(run, outcome)
    assert finished.message is not None and finished.message.content == "<tool_call>It is 42"
    replay = await memory_store.read_run_output(user, run.run_id, after_seq=4)
    assert [(d.seq, d.step) for d in replay] == [(5, ""), (6, started), (7, "")]


async def test_logprobs_are_stored_with_their_events_in_checkpoints_and_the_tail(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "logprobs")
    run, _ = await start_run(memory_store, user, chat.chat_id, "how sure are you?")
    # Opaque bytes to the store (the orchestrator's encoding); an event may have none.
    first = [RunDelta(2, "Quite", 1, (7,), logprobs=b"\x1a\x05lp-7"), RunDelta(3, "", 1, (8,))]
    await checkpoint(memory_store, run, first)
    await checkpoint(memory_store, run, [RunDelta(4, " sure", 2, (9, 10), logprobs=b"lp-9-10")])
    untouched = RunDelta(5, ".", 1, (11,))
    await checkpoint(memory_store, run, [untouched])  # a row with no logprobs at all
    tail = (RunDelta(6, "!", 1, (12,), logprobs=b"lp-12"),)
    outcome = RunOutcome(
        status=RunStatus.COMPLETED,
        last_seq=8,
        finish_reason=FinishReason.STOP,
        tail=tail,
        usage=Usage(prompt_tokens=9, completion_tokens=6),
    )
    await memory_store.finish_run(run, outcome)
    assert await memory_store.read_run_output(user, run.run_id) == [
        *first,
        RunDelta(4, " sure", 2, (9, 10), logprobs=b"lp-9-10"),
        untouched,
        *tail,
    ]
    # They count against a checkpoint's size, like its text.
    too_big = b"x" * (memory_store.bounds.max_checkpoint_bytes + 1)
    with pytest.raises(InvalidArgument, match="logprobs"):
        await checkpoint(memory_store, run, [RunDelta(9, "a", 1, (1,), logprobs=too_big)])


async def test_of_two_replicas_storing_a_step_at_one_seq_the_first_keeps_it(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "one step")
    run, _ = await start_run(memory_store, user, chat.chat_id, "what time is it?")
    await checkpoint(memory_store, run, [RunDelta(2, "<tool_call>", 2, (10, 11))])
    mine = '{"started": {"call_id": "c1", "tool": "clock", "arguments": "{}"}, "by": "replica-a"}'
    theirs = '{"started": {"call_id": "c1", "tool": "clock", "arguments": "{}"}, "by": "replica-b"}'
    assert await memory_store.store_step(run, RunDelta(3, "", 0, (), mine)) == mine
    assert await memory_store.store_step(run, RunDelta(3, "", 0, (), mine)) == mine  # a retry: its own
    assert await memory_store.store_step(run, RunDelta(3, "", 0, (), theirs)) == mine
    assert await memory_store.store_step(run, RunDelta(2, "", 0, (), theirs)) == ""  # a text event
    assert [d.step for d in await memory_store.read_run_output(user, run.run_id)] == ["", mine]
    with pytest.raises(InvalidArgument, match="step record"):
        await memory_store.store_step(run, RunDelta(4, "text", 1, (12,)))


async def test_retried_finish_stores_the_answer_once_and_counts_usage_once(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "finish twice")
    run, asked = await start_run(memory_store, user, chat.chat_id, "2+2?")
    await checkpoint(memory_store, run, deltas(2, "It", " is"))
    outcome = RunOutcome(
        status=RunStatus.COMPLETED,
        last_seq=6,
        finish_reason=FinishReason.STOP,
        tail=tuple(deltas(4, " 4", ".")),
        usage=Usage(prompt_tokens=12, cached_prompt_tokens=8, completion_tokens=4),
    )
    first, second = await memory_store.finish_run(run, outcome), await memory_store.finish_run(run, outcome)

    assert (first.applied, second.applied) == (True, False)
    assert first.message == second.message
    assert first.message.content == "It is 4."
    assert (first.message.role, first.message.parent_id, first.message.status) == (
        Role.ASSISTANT,
        asked.message_id,
        MessageStatus.COMPLETE,
    )
    stored = (await memory_store.list_messages(user, chat.chat_id)).items
    assert [m.message_id for m in stored] == [run.assistant_message_id, asked.message_id]
    assert stored[0] == first.message
    usage = await memory_store.get_usage(user)
    assert (usage.usage, usage.runs) == (Usage(12, 8, 4), 1)
    final = await memory_store.get_run(user, run.run_id)
    assert (final.status, final.finish_reason, final.last_seq) == (RunStatus.COMPLETED, FinishReason.STOP, 6)
    assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id is None


async def test_an_owner_finishing_with_its_output_reads_nothing_back_and_stores_the_same(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "the owner knows its answer")
    run, asked = await start_run(memory_store, user, chat.chat_id, "2+2?", prompt_tokens=12)
    await checkpoint(memory_store, run, deltas(2, "It", " is"))
    tail = deltas(4, " 4", ".")
    outcome = RunOutcome(RunStatus.COMPLETED, 6, FinishReason.STOP, tail=tuple(tail), usage=Usage(12, 8, 4))
    output = deltas(2, "It", " is") + tail

    before = operations_counted()
    finished = await memory_store.finish_run(run, outcome, output)
    sent = requests_sent(before)

    assert finished.applied
    assert not {"run_read", "run_get", "message_get"} & set(sent), sent
    # The chat's active run is cleared in the same mutation as the answer's search entry and activity.
    assert "chat_set_last_finished_run" not in sent, sent
    assert any("chat_set_last_finished_run" in name and "activity_insert" in name for name in sent), sent
    # The answer, the run's usage and its owner-index entry's removal go in one request: with the
    # finish itself and the chat's ownership check, three in all.
    assert any(
        all(write in name for write in ("message_insert", "usage_put", "owner_index_delete")) for name in sent
    )
    assert sum(sent.values()) == 3, sent
    stored_run = await memory_store.get_run(user, run.run_id)
    assert finished.run == dataclasses.replace(stored_run, checkpointed_at=None)
    assert finished.message == await memory_store.get_message(user, chat.chat_id, run.assistant_message_id)
    assert (finished.message.content, finished.message.parent_id) == ("It is 4.", asked.message_id)
    assert (await memory_store.get_usage(user)).usage == Usage(12, 8, 4)
    assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id is None

    # A finish that loses reads the run as it ended, whatever output it was handed.
    late = await memory_store.finish_run(
        run, RunOutcome(RunStatus.CANCELLED, 3, FinishReason.CANCELLED), deltas(2, "It")
    )
    assert not late.applied
    assert (late.run.status, late.message) == (RunStatus.COMPLETED, finished.message)


async def test_racing_finishes_have_one_winner_and_one_answer(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "cancel vs complete")
    run, _ = await start_run(memory_store, user, chat.chat_id, "long answer please")
    await checkpoint(memory_store, run, deltas(2, "Partial"))
    complete = RunOutcome(RunStatus.COMPLETED, 4, FinishReason.STOP, tail=tuple(deltas(3, " and", " done")))
    cancel = RunOutcome(RunStatus.CANCELLED, 2, FinishReason.CANCELLED)

    results = await asyncio.gather(*(memory_store.finish_run(run, o) for o in [complete, cancel] * 3))

    winners = [r for r in results if r.applied]
    assert len(winners) == 1
    final = winners[0].run
    assert all(r.run == final and r.message == winners[0].message for r in results)
    expected = "Partial and done" if final.status is RunStatus.COMPLETED else "Partial"
    stored = await memory_store.get_message(user, chat.chat_id, run.assistant_message_id)
    assert stored.content == expected


async def test_late_checkpoint_does_not_change_a_finished_answer(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "zombie owner")
    run, _ = await start_run(memory_store, user, chat.chat_id, "hi")
    await checkpoint(memory_store, run, deltas(2, "Hel"))
    finished = await memory_store.finish_run(run, RunOutcome(RunStatus.CANCELLED, 2, FinishReason.CANCELLED))
    await checkpoint(memory_store, run, deltas(3, "lo from a zombie"))

    again = await memory_store.finish_run(run, RunOutcome(RunStatus.COMPLETED, 3, FinishReason.STOP))
    assert not again.applied and again.message == finished.message
    assert finished.message.content == "Hel" and finished.message.status is MessageStatus.INCOMPLETE
    assert [d.text for d in await memory_store.read_run_output(user, run.run_id)] == ["Hel"]
    assert (await memory_store.get_run(user, run.run_id)).last_seq == 2


async def test_two_starters_checkpointing_one_run_alike_leave_it_readable(memory_store):
    # Two attempts started the same run id (a lease that passed on too early) and generated apart:
    # their checkpoints of the same events carry the same write timestamp, so Cassandra keeps each
    # cell by value, possibly one writer's texts beside the other's counts. Every list of a row is
    # one writer's whole list, all as long as the row's events: a read never meets lists of unequal
    # length (the strict zip in runs._deltas holds), whichever cells won.
    user = new_user()
    chat = await memory_store.create_chat(user, "two starters")
    run, _ = await start_run(memory_store, user, chat.chat_id, "hi")
    first = [RunDelta(2, "Once", 1, (5,)), RunDelta(3, " upon", 2, (6, 7))]
    second = [RunDelta(2, "Hi", 2, (8, 9)), RunDelta(3, " there", 1, (10,))]
    await checkpoint(memory_store, run, first)
    await checkpoint(memory_store, dataclasses.replace(run, owner_id="replica-b"), second)
    output = await memory_store.read_run_output(user, run.run_id)
    assert [d.seq for d in output] == [2, 3]
    assert all(len(d.token_ids) in (0, d.token_count) for d in output)
    assert (await memory_store.get_run(user, run.run_id)).last_seq == 3


async def test_failed_run_without_output_stores_no_message(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "engine down")
    run, asked = await start_run(memory_store, user, chat.chat_id, "hello?")
    failed = await memory_store.finish_run(
        run,
        RunOutcome(
            RunStatus.FAILED, 1, FinishReason.ERROR, error_code="UNAVAILABLE", error_message="no engine"
        ),
    )
    assert failed.message is None
    assert (failed.run.error_code, failed.run.error_message) == ("UNAVAILABLE", "no engine")
    # With no answer to go with, the run's usage is charged and the chat's active run cleared anyway.
    assert (await memory_store.get_usage(user)).runs == 1
    assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id is None
    assert [m.message_id for m in (await memory_store.list_messages(user, chat.chat_id)).items] == [
        asked.message_id
    ]
    with pytest.raises(InvalidArgument):
        await memory_store.finish_run(run, RunOutcome(RunStatus.IN_PROGRESS, 1))


async def test_a_replica_finds_its_own_runs_and_takes_them_up_again_keeping_their_index_entry(memory_store):
    user = new_user()
    owner = f"replica-own-{user}"
    chat = await memory_store.create_chat(user, "own runs")
    stray, _ = await start_run(memory_store, user, chat.chat_id, "q1", owner=owner)
    held, _ = await start_run(memory_store, user, chat.chat_id, "q2", owner=owner)

    found = await memory_store.find_owned_runs(owner, skip=lambda run_id: run_id == held.run_id)
    assert [r.run_id for r in found] == [stray.run_id]
    assert found[0].status is RunStatus.IN_PROGRESS and found[0].owner_id == owner

    # Its owner takes it up again: still its own, still in its index (found again if it dies now).
    taken = await memory_store.adopt_run(found[0], owner)
    assert taken is not None and taken.owner_id == owner
    assert {r.run_id for r in await memory_store.find_owned_runs(owner)} == {stray.run_id, held.run_id}
    # Not once it ended, or once another replica owns it.
    await memory_store.finish_run(taken, RunOutcome(RunStatus.CANCELLED, 2, FinishReason.CANCELLED))
    assert await memory_store.adopt_run(found[0], owner) is None
    assert await memory_store.adopt_run(held, f"replica-other-{user}") is not None
    assert await memory_store.adopt_run(held, owner) is None
    assert await memory_store.find_owned_runs(owner) == []


async def test_runs_of_a_silent_replica_are_found_and_interrupted(memory_store):
    user = new_user()
    dead, alive = f"replica-dead-{user}", f"replica-alive-{user}"
    await memory_store.heartbeat_replica(dead, at=now() - timedelta(seconds=120))
    await memory_store.heartbeat_replica(alive)
    chat = await memory_store.create_chat(user, "lost replica")
    orphan, _ = await start_run(memory_store, user, chat.chat_id, "q1", owner=dead, prompt_tokens=40)
    healthy, _ = await start_run(memory_store, user, chat.chat_id, "q2", owner=alive)
    await checkpoint(memory_store, orphan, deltas(2, "half an ", "answer"))
    # The orphan's owner reserved prompt + max_tokens when it started.
    await memory_store.record_usage(user, orphan.run_id, Usage(40, 0, 512))

    found = [r for r in await memory_store.find_orphaned_runs(stale_after_s=30) if r.user_id == user]
    assert [r.run_id for r in found] == [orphan.run_id]
    # Another deployment's replicas (another group) never take them.
    elsewhere = await memory_store.find_orphaned_runs(stale_after_s=30, group=f"other-{user}")
    assert orphan.run_id not in {r.run_id for r in elsewhere}
    assert found[0].last_seq == 3

    interrupted = await memory_store.finish_run(
        found[0], RunOutcome(RunStatus.INTERRUPTED, found[0].last_seq)
    )
    assert interrupted.applied and interrupted.run.status is RunStatus.INTERRUPTED
    assert interrupted.message.content == "half an answer"
    assert interrupted.message.status is MessageStatus.INCOMPLETE
    # The reservation is reconciled to what the run stored: its prompt and the output kept.
    charged = Usage(40, 0, sum(d.token_count for d in deltas(2, "half an ", "answer")))
    assert (await memory_store.get_usage(user)).usage == charged
    assert orphan.run_id not in {r.run_id for r in await memory_store.find_orphaned_runs(stale_after_s=30)}
    assert (await memory_store.get_run(user, healthy.run_id)).status is RunStatus.IN_PROGRESS
    # The second pass found nothing left of the silent replica and forgot it: no more scans of it.
    replicas = await memory_store._db.execute("replica_list", ("orchestrator",))
    assert dead not in {r["replica_id"] for r in replicas} and alive in {r["replica_id"] for r in replicas}


async def test_a_run_ended_by_an_owner_that_died_before_storing_its_answer_is_settled(
    memory_store, monkeypatch
):
    user = new_user()
    owner = f"replica-lost-{user}"
    await memory_store.heartbeat_replica(owner)
    chat = await memory_store.create_chat(user, "lost between the finish and the answer")
    run, asked = await start_run(memory_store, user, chat.chat_id, "q", owner=owner, prompt_tokens=40)
    await checkpoint(memory_store, run, deltas(2, "an "))
    output = deltas(2, "an ", "answer")

    # The owner's finish wins; the request with its answer then fails (a node timed out), and the owner
    # dies before its retry.
    async def timed_out(*args, **kwargs):
        raise Unavailable("Cassandra did not answer in time")

    with monkeypatch.context() as patched:
        patched.setattr(memory_store._db, "write", timed_out)
        with pytest.raises(Unavailable):
            await memory_store.finish_run(
                run,
                RunOutcome(
                    RunStatus.COMPLETED, 4, FinishReason.STOP, tail=tuple(output[1:]), usage=Usage(40, 0, 2)
                ),
                output,
            )
    assert (await memory_store.get_run(user, run.run_id)).status is RunStatus.COMPLETED
    history = (await memory_store.get_branch(user, chat.chat_id, None)).messages
    assert [m.message_id for m in history] == [asked.message_id]

    # While its owner heartbeats, the run is its owner's (whose retry stores the end).
    assert run.run_id not in {r.run_id for r in await memory_store.find_orphaned_runs(stale_after_s=30)}
    await memory_store.heartbeat_replica(owner, at=now() - timedelta(seconds=120))
    [found] = [r for r in await memory_store.find_orphaned_runs(stale_after_s=30) if r.user_id == user]
    assert (found.run_id, found.status) == (run.run_id, RunStatus.COMPLETED)

    settled = await memory_store.settle_run(found)
    assert not settled.applied and settled.run.status is RunStatus.COMPLETED
    answer = settled.message
    assert (answer.message_id, answer.content) == (run.assistant_message_id, "an answer")
    assert (answer.status, answer.parent_id) == (MessageStatus.COMPLETE, asked.message_id)
    assert (await memory_store.get_usage(user)).usage == Usage(40, 0, 2)
    assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id is None
    # Settled twice (two reapers): the same answer, stored once.
    await memory_store.settle_run(found)
    history = (await memory_store.get_branch(user, chat.chat_id, None)).messages
    assert [(m.message_id, m.content) for m in history] == [
        (asked.message_id, "q"),
        (answer.message_id, "an answer"),
    ]
    # It left its owner's index: the next pass finds nothing of the owner, and forgets it.
    assert run.run_id not in {r.run_id for r in await memory_store.find_orphaned_runs(stale_after_s=30)}
    replicas = await memory_store._db.execute("replica_list", ("orchestrator",))
    assert owner not in {r["replica_id"] for r in replicas}


async def test_writes_that_mark_others_done_never_land_before_them(memory_store, monkeypatch):
    store_db, owner = memory_store._db, f"replica-{new_user()}"
    done_entry, *entries = [uuid1() for _ in range(7)]
    await store_db.execute("owner_index_insert", (owner, 1, done_entry))

    def inserted(run_id):
        return [("owner_index_insert", (owner, 2, run_id))]

    removed = [[("owner_index_delete", (owner, 1, done_entry))]]

    async def indexed(bucket):
        return {row["run_id"] for row in await store_db.execute("owner_index_scan", (owner, bucket))}

    # When everything fits in one request, the mark goes in it.
    before = operations_counted()
    await store_db.write([inserted(entries[0]), inserted(entries[1])], 40_000, then=removed)
    assert sum(requests_sent(before).values()) == 1
    assert (await indexed(1), await indexed(2)) == (set(), {entries[0], entries[1]})

    # When the writes take two requests (here: too many bytes for one), the mark is sent once both
    # succeeded, and not at all if one fails.
    await store_db.execute("owner_index_insert", (owner, 1, done_entry))
    execute, seen = store_db.execute, []

    async def spied(statement, *args, fail=False, **kwargs):
        seen.append(("sent", kwargs["operation"]))
        if fail:
            raise Unavailable("Cassandra did not answer in time")
        rows = await execute(statement, *args, **kwargs)
        seen.append(("done", kwargs["operation"]))
        return rows

    with monkeypatch.context() as patched:
        patched.setattr(store_db, "execute", spied)
        await store_db.write([inserted(entries[2]), inserted(entries[3])], 1, then=removed)
    assert seen == [("sent", "owner_index_insert")] * 2 + [("done", "owner_index_insert")] * 2 + [
        ("sent", "owner_index_delete"),
        ("done", "owner_index_delete"),
    ]
    assert await indexed(1) == set()

    await store_db.execute("owner_index_insert", (owner, 1, done_entry))
    seen.clear()
    with monkeypatch.context() as patched:
        patched.setattr(store_db, "execute", lambda *a, **k: spied(*a, fail=not seen, **k))
        with pytest.raises(Unavailable):
            await store_db.write([inserted(entries[4]), inserted(entries[5])], 1, then=removed)
    assert ("sent", "owner_index_delete") not in seen
    assert await indexed(1) == {done_entry}


async def test_a_silent_replicas_run_is_adopted_by_exactly_one_replica_with_what_it_needs(memory_store):
    user = new_user()
    dead = f"replica-dead-{user}"
    await memory_store.heartbeat_replica(dead, at=now() - timedelta(seconds=120))
    chat = await memory_store.create_chat(user, "adopted")
    run, _ = await start_run(memory_store, user, chat.chat_id, "q", owner=dead, generation=b"\x08\x01how")
    await checkpoint(
        memory_store,
        run,
        [RunDelta(2, "Hel", 2, (15, 16)), RunDelta(3, "lo", 1, (17,)), RunDelta(4, "!", 0, ())],
    )
    [orphan] = [r for r in await memory_store.find_orphaned_runs(stale_after_s=30) if r.user_id == user]
    assert orphan.generation == b"\x08\x01how"

    takers = [f"replica-{i}-{user}" for i in range(5)]
    adopted = await asyncio.gather(*(memory_store.adopt_run(orphan, taker) for taker in takers))
    winners = [a for a in adopted if a is not None]
    assert len(winners) == 1 and winners[0].owner_id in takers
    assert (await memory_store.get_run(user, run.run_id)).owner_id == winners[0].owner_id
    # The adopter continues from the checkpointed output, its token ids included.
    output = await memory_store.read_run_output(user, run.run_id)
    assert [(d.seq, d.text, d.token_ids) for d in output] == [
        (2, "Hel", (15, 16)),
        (3, "lo", (17,)),
        (4, "!", ()),
    ]
    # The run is indexed under its new owner: if the adopter dies too, the run is found again.
    await memory_store.heartbeat_replica(winners[0].owner_id, at=now() - timedelta(seconds=120))
    again = [r for r in await memory_store.find_orphaned_runs(stale_after_s=30) if r.user_id == user]
    assert [r.owner_id for r in again] == [winners[0].owner_id]


async def test_an_owner_whose_run_was_adopted_cannot_finish_it(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "paused owner")
    run, _ = await start_run(memory_store, user, chat.chat_id, "q", owner="replica-paused")
    adopted = await memory_store.adopt_run(run, "replica-adopter")
    assert adopted is not None

    # The old owner wakes up (it was only paused) and tries to store its end: the adopter's run stands.
    with pytest.raises(OwnerChanged):
        await memory_store.finish_run(run, RunOutcome(RunStatus.COMPLETED, 3, FinishReason.STOP))
    assert (await memory_store.get_run(user, run.run_id)).status is RunStatus.IN_PROGRESS
    assert await memory_store.adopt_run(run, "replica-third") is None  # taken from the old owner: stale
    # Its last checkpoint and the adopter's overlap (other first_seqs, the same events): each event once.
    await checkpoint(memory_store, run, [RunDelta(2, "o", 1, (9,)), RunDelta(3, "k", 1, (10,))])
    await checkpoint(memory_store, adopted, [RunDelta(3, "k", 1, (10,)), RunDelta(4, "!", 1, (11,))])
    output = await memory_store.read_run_output(user, run.run_id)
    assert [(d.seq, d.text, d.token_ids) for d in output] == [
        (2, "o", (9,)),
        (3, "k", (10,)),
        (4, "!", (11,)),
    ]
    finished = await memory_store.finish_run(adopted, RunOutcome(RunStatus.COMPLETED, 6, FinishReason.STOP))
    assert finished.applied and finished.message.content == "ok!"


async def test_a_run_created_with_its_question_stores_both_and_never_the_run_alone(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "one call")
    claim = await memory_store.claim_idempotency_key(user, "send", b"fingerprint")
    asked = message(chat.chat_id, "the question", message_id=claim.user_message_id)
    # A run answering a message that is not in the chat: refused, and the run not stored.
    ghost = message(chat.chat_id, "never stored", at=now() - timedelta(seconds=5))
    with pytest.raises(FailedPrecondition):
        await memory_store.create_run(new_run(user, chat, claim, ghost))
    # A question that is not the run's: refused, and neither the question nor the run stored.
    with pytest.raises(InvalidArgument):
        await memory_store.create_run_with_question(
            dataclasses.replace(new_run(user, chat, claim, asked), user_message_id=None), asked, chat
        )
    assert (await memory_store.list_messages(user, chat.chat_id)).items == []
    with pytest.raises(NotFound):
        await memory_store.get_run(user, claim.run_id)

    run = await memory_store.create_run_with_question(new_run(user, chat, claim, asked), asked, chat)
    assert [m.content for m in (await memory_store.list_messages(user, chat.chat_id)).items] == [
        "the question"
    ]
    assert run.user_message_id == asked.message_id and run.parent_message_id == asked.message_id
    assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id == claim.run_id


async def test_a_run_created_with_the_chat_read_in_its_request_stores_its_question_without_reading(
    memory_store,
):
    user = new_user()
    chat = await memory_store.create_chat(user, "read once")
    first = await memory_store.append_message(user, message(chat.chat_id, "before"))
    branch = await memory_store.get_branch(user, chat.chat_id, None)
    claim = await memory_store.claim_idempotency_key(user, "send", b"fingerprint")
    asked = message(chat.chat_id, "the question", first, message_id=claim.user_message_id)
    other = await memory_store.create_chat(user, "another chat")
    with pytest.raises(InvalidArgument):
        await memory_store.create_run_with_question(new_run(user, chat, claim, asked), asked, other)
    assert [m.content for m in (await memory_store.list_messages(user, chat.chat_id)).items] == ["before"]

    run = await memory_store.create_run_with_question(new_run(user, chat, claim, asked), asked, branch.chat)
    assert [m.content for m in (await memory_store.list_messages(user, chat.chat_id)).items] == [
        "the question",
        "before",
    ]
    assert (await memory_store.get_run(user, claim.run_id)).user_message_id == asked.message_id
    stored = await memory_store.get_chat(user, chat.chat_id)
    assert stored.active_run_id == run.run_id and stored.updated_at > branch.chat.updated_at


async def test_a_question_and_its_run_go_as_one_batch_and_a_large_question_first_then_its_run(
    memory_store,
):
    user = new_user()
    chat = await memory_store.create_chat(user, "one round trip")
    # Distinct words: the search entry's set of terms is as large as the text.
    words = " ".join(f"w{i}" for i in range(20_000))
    parent = None
    for size, generation, batches in (
        (100, b"", 1),
        (4 * 1024, b"\x07" * 4096, 1),  # ~29 KB by the store's estimate: one batch
        (32 * 1024, b"\x07" * 8192, 0),  # over Cassandra's 50 KiB: the question first, then the run
    ):
        claim = await memory_store.claim_idempotency_key(user, f"send-{size}", b"fingerprint")
        asked = message(chat.chat_id, words[:size].strip(), parent, message_id=claim.user_message_id)
        before = operations_counted()
        await memory_store.create_run_with_question(
            new_run(user, chat, claim, asked, generation=generation), asked, chat
        )
        sent = requests_sent(before)
        together = sum(n for name, n in sent.items() if "message_insert" in name and "run_insert" in name)
        assert together == batches, sent
        if not batches:  # the question first (with the run's index entry), then the run
            names = " ".join(sent)
            assert all(write in names for write in ("run_insert", "message_insert", "owner_index_insert"))
        run = await memory_store.get_run(user, claim.run_id)
        stored = await memory_store.get_message(user, chat.chat_id, claim.user_message_id)
        assert (run.user_message_id, run.generation, stored.content) == (
            asked.message_id,
            generation,
            asked.content,
        )
        assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id == claim.run_id
        chat, parent = await memory_store.get_chat(user, chat.chat_id), asked


async def test_usage_is_per_run_and_idempotent(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "budget")
    first, _ = await start_run(memory_store, user, chat.chat_id, "a")
    second, _ = await start_run(memory_store, user, chat.chat_id, "b")
    # An estimate at start, replaced by the actual count at the end; retried records change nothing.
    await memory_store.record_usage(user, first.run_id, Usage(100, 0, 512))
    for _ in range(3):
        await memory_store.record_usage(user, first.run_id, Usage(100, 50, 20))
    await memory_store.record_usage(user, second.run_id, Usage(30, 0, 7))

    window = await memory_store.get_usage(user)
    assert window.usage == Usage(130, 50, 27)
    assert window.usage.total_tokens == 157 and window.runs == 2
    assert window.start <= now() < window.end
    assert (await memory_store.get_usage(user, at=now() - timedelta(days=1))).runs == 0
    assert (await memory_store.get_usage(new_user())).usage == Usage()


async def test_a_signal_reaches_its_owner_in_its_window_and_no_one_else(memory_store):
    user = new_user()
    owner, other = f"replica-owner-{user}", f"replica-other-{user}"
    chat = await memory_store.create_chat(user, "signalled")
    cancelled, _ = await start_run(memory_store, user, chat.chat_id, "q1", owner=owner)
    adopted, _ = await start_run(memory_store, user, chat.chat_id, "q2", owner=owner)
    quiet, _ = await start_run(memory_store, user, chat.chat_id, "q3", owner=owner)
    at = now()
    await memory_store.signal_owner(cancelled, at=at)
    await memory_store.signal_owner(adopted, at=at + timedelta(seconds=30))
    # Signalled twice (a retried write): still one row.
    await memory_store.signal_owner(adopted, at=at + timedelta(seconds=30))

    window = await memory_store.signalled_runs(owner, at - timedelta(seconds=1), at + timedelta(seconds=40))
    assert window == {cancelled.run_id, adopted.run_id}
    assert quiet.run_id not in window
    assert (
        await memory_store.signalled_runs(owner, at - timedelta(seconds=60), at - timedelta(seconds=20))
        == set()
    )
    later = await memory_store.signalled_runs(owner, at + timedelta(seconds=25), at + timedelta(seconds=35))
    assert later == {adopted.run_id}
    assert (
        await memory_store.signalled_runs(other, at - timedelta(seconds=1), at + timedelta(seconds=40))
        == set()
    )
    # A window past what signals live is refused, as is one that ends before it starts.
    with pytest.raises(InvalidArgument):
        await memory_store.signalled_runs(owner, at - timedelta(hours=1), at)
    with pytest.raises(InvalidArgument):
        await memory_store.signalled_runs(owner, at, at - timedelta(seconds=30))


async def test_a_checkpoint_is_counted_but_makes_no_span_and_a_read_makes_one(memory_store, monkeypatch):
    # A running answer checkpoints once a second: a span each would crowd its send's trace.
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(db, "_tracer", provider.get_tracer("test"))
    user = new_user()
    chat = await memory_store.create_chat(user, "traced")
    run, _ = await start_run(memory_store, user, chat.chat_id, "q")
    before = operations_counted()
    spans.clear()

    await checkpoint(memory_store, run, deltas(2, "a", "b"))
    await memory_store.get_run(user, run.run_id)

    assert [s.name for s in spans.get_finished_spans()] == ["run_get"]
    assert requests_sent(before) == {"run_checkpoint": 1, "run_get": 1}


async def test_several_runs_checkpoints_go_in_one_request_and_each_reads_back(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "checkpointed together")
    runs = [(await start_run(memory_store, user, chat.chat_id, f"q{i}"))[0] for i in range(5)]
    before = operations_counted()

    stored = await memory_store.checkpoint_runs(
        [(run, deltas(2, f"run {i} ", "says")) for i, run in enumerate(runs)]
    )

    assert stored == [True] * 5
    assert requests_sent(before) == {"run_checkpoint (unlogged batch)": 1}
    for i, run in enumerate(runs):
        output = await memory_store.read_run_output(user, run.run_id)
        assert [(d.seq, d.text) for d in output] == [(2, f"run {i} "), (3, "says")]
        assert (await memory_store.get_run(user, run.run_id)).last_seq == 3


async def test_unlogged_writes_are_split_by_partitions_and_bytes(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "split")
    runs = [(await start_run(memory_store, user, chat.chat_id, f"q{i}"))[0] for i in range(5)]
    writes = [memory_store.runs.checkpoint_write(run, deltas(2, "x" * 100)) for run in runs]
    before = operations_counted()

    assert await memory_store._db.write_unlogged(writes, 64 * 1024, max_partitions=2) == [True] * 5
    assert sum(requests_sent(before).values()) == 3  # 2 + 2 + 1
    before = operations_counted()
    assert await memory_store._db.write_unlogged(writes, 0, max_partitions=64) == [True] * 5
    assert requests_sent(before) == {"run_checkpoint": 5}  # no room for two: each alone


async def test_a_replicas_pass_of_64_running_answers_goes_in_one_request_under_the_batch_limit(memory_store):
    # Each answer's half second: 16 one-token events with their token ids. A checkpoint's lists are
    # frozen (one cell each), so the pass fits the store's 40 KiB: sized as a cell per element, it took 3.
    user = new_user()
    chat = await memory_store.create_chat(user, "a full pass")
    runs = await asyncio.gather(*(start_run(memory_store, user, chat.chat_id, f"q{i}") for i in range(64)))
    events = [RunDelta(2 + i, f" word{i}", 1, (1000 + i,)) for i in range(16)]
    before = operations_counted()

    stored = await memory_store.checkpoint_runs([(run, events) for run, _ in runs])

    assert stored == [True] * 64  # Cassandra took the batch (it refuses one over 50 KiB)
    assert requests_sent(before) == {"run_checkpoint (unlogged batch)": 1}
    output = await memory_store.read_run_output(user, runs[-1][0].run_id)
    assert [(d.seq, d.text, d.token_ids) for d in output] == [(d.seq, d.text, d.token_ids) for d in events]


async def test_a_collection_that_is_not_frozen_is_sized_a_cell_per_element(memory_store):
    # A message's search terms are a set (a cell per word: what Cassandra counts in a batch); a
    # checkpoint's token ids a frozen list (one cell).
    bind = memory_store._db._bind
    terms = {f"term{i}" for i in range(100)}
    words = bind(("search_add", ("user", "text", terms, "u", uuid1(), uuid1())))
    one = bind(("search_add", ("user", "text", {"term0"}, "u", uuid1(), uuid1())))
    assert words.size - one.size >= sum(len(term) + 16 for term in terms - {"term0"})
    user = new_user()
    chat = await memory_store.create_chat(user, "sized")
    run, _ = await start_run(memory_store, user, chat.chat_id, "q")
    long = bind(memory_store.runs.checkpoint_write(run, [RunDelta(2, "x" * 100, 100, tuple(range(100)))]))
    short = bind(memory_store.runs.checkpoint_write(run, [RunDelta(2, "x", 1, (0,))]))
    assert long.size - short.size < 99 * 16  # less than a cell per further id
