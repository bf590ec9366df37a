"""The in-memory run buffer and the events rebuilt from Cassandra (pure logic, no services)."""

from __future__ import annotations

import asyncio

import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError
from chatmesh.finish import FinishReason, Usage
from chatmesh.run_events import MAX_MERGED_DELTAS, merged_delta
from memory_store.models import RunDelta, RunStatus
from meshkit.arrivals import Wakeup
from meshkit.event_loop import RecentLag
from meshkit.pacing import StreamPacer
from orchestrator.runs.held_run import HeldRun, RunInfo
from orchestrator.runs.replay import INTERRUPTED_CODE, started_event, terminal_events
from orchestrator.runs.run_state import RunState
from tests.fixtures.runs import stored_run


def held_run(max_tokens: int = 100, max_subscribers: int = 4, pacer: StreamPacer | None = None) -> HeldRun:
    info = RunInfo("run-1", "user-1", "pro", "send", "model", max_tokens, chat_id="chat-1")
    run = HeldRun(info, max_subscribers, pacer or StreamPacer(0.0))
    run.append(started=chat_pb2.RunStarted(run_id="run-1"))
    return run


async def drain(stream) -> list[int]:
    return [event.seq async for event in stream]


async def test_followers_from_any_seq_get_every_later_event_once_then_the_live_ones() -> None:
    run = held_run()
    for i in range(5):
        run.append_delta(f"t{i}", 1)
    followers = [asyncio.create_task(drain(run.follow(after))) for after in (0, 1, 3, 6)]
    await asyncio.sleep(0)
    for i in range(5, 8):
        run.append_delta(f"t{i}", 1)
        await asyncio.sleep(0)
    run.append(done=chat_pb2.Done())
    run.finish(chat_pb2.RUN_STATUS_COMPLETED)
    seen = await asyncio.gather(*followers)
    for after, seqs in zip((0, 1, 3, 6), seen, strict=True):
        assert seqs == list(range(after + 1, 11))


async def test_a_follower_that_does_not_read_never_holds_up_the_writer_or_other_followers() -> None:
    run = held_run(max_tokens=1000)
    stalled = run.follow(0)
    assert (await anext(stalled)).seq == 1  # attached, then never reads again
    reader = asyncio.create_task(drain(run.follow(0)))
    for _ in range(1000):
        run.append_delta("x", 1)
    run.append(done=chat_pb2.Done())
    run.finish(chat_pb2.RUN_STATUS_COMPLETED)
    assert len(await asyncio.wait_for(reader, 5)) == 1002
    # The stalled one resumes from where it was, with nothing missing.
    assert [e.seq async for e in stalled] == list(range(2, 1003))


def described(event: chat_pb2.RunEvent) -> tuple:
    kind = event.WhichOneof("kind")
    return (
        (event.seq, kind, event.delta.text, event.delta.token_count) if kind == "delta" else (event.seq, kind)
    )


async def test_a_follower_asking_to_merge_gets_the_waiting_deltas_as_one_and_each_live_one_alone() -> None:
    run = held_run()
    for i in range(4):
        run.append_delta(f"t{i}", 1 + i % 2)
    merged = run.follow(0, merge_deltas=True)
    assert described(await anext(merged)) == (1, "started")  # never merged with what follows
    assert described(await anext(merged)) == (5, "delta", "t0t1t2t3", 6)
    # Keeping up: each delta comes alone, as it is made.
    for i in range(4, 6):
        reading = asyncio.ensure_future(anext(merged))
        await asyncio.sleep(0)
        run.append_delta(f"t{i}", 1)
        assert described(await reading) == (i + 2, "delta", f"t{i}", 1)
    # Behind: the deltas of one router frame, appended at once, come as one; the end is not merged in.
    for i in range(6, 9):
        run.append_delta(f"t{i}", 1)
    run.append(usage=chat_pb2.Usage())
    run.append(done=chat_pb2.Done())
    run.finish(chat_pb2.RUN_STATUS_COMPLETED)
    assert [described(e) async for e in merged] == [(10, "delta", "t6t7t8", 3), (11, "usage"), (12, "done")]
    # A follower that did not ask gets one event per sequence number, and resumes inside a merged delta.
    assert [e.seq async for e in run.follow(0)] == list(range(1, 13))
    resumed = [described(e) async for e in run.follow(3, merge_deltas=True)]
    assert resumed == [(10, "delta", "t2t3t4t5t6t7t8", 8), (11, "usage"), (12, "done")]


async def test_a_merged_delta_carries_at_most_the_bound_so_a_late_follower_gets_a_long_answer_in_parts() -> (
    None
):
    run = held_run(max_tokens=600)
    for _ in range(600):
        run.append_delta("x", 1)
    run.append(done=chat_pb2.Done())
    run.finish(chat_pb2.RUN_STATUS_COMPLETED)
    events = [e async for e in run.follow(1, merge_deltas=True)]
    assert [(e.seq, e.delta.token_count) for e in events[:-1]] == [
        (1 + MAX_MERGED_DELTAS, MAX_MERGED_DELTAS),
        (1 + 2 * MAX_MERGED_DELTAS, MAX_MERGED_DELTAS),
        (601, 600 - 2 * MAX_MERGED_DELTAS),
    ]
    assert "".join(e.delta.text for e in events) == "x" * 600 and events[-1].seq == 602


async def test_the_buffer_is_bounded_by_max_tokens_and_followers_by_the_subscriber_limit() -> None:
    run = held_run(max_tokens=3, max_subscribers=1)
    assert run.last_seq == 1  # started
    # A delta a token, and one more: the text an engine held back (the start of a stop string, part
    # of a character) and flushed when max_tokens ended the answer.
    for _ in range(3):
        run.append_delta("x", 1)
    run.append_delta("held back", 0)
    with pytest.raises(RuntimeError):
        run.append_delta("too many", 1)
    # The end always fits.
    run.append(usage=chat_pb2.Usage())
    run.append(done=chat_pb2.Done())
    run.finish(chat_pb2.RUN_STATUS_COMPLETED)
    assert run.last_seq == 7
    first = run.follow(0)
    await anext(first)
    with pytest.raises(ServiceError) as caught:
        await anext(run.follow(0))
    assert caught.value.code.name == "RESOURCE_EXHAUSTED"


def deltas(count: int) -> list[RunDelta]:
    return [RunDelta(seq, f"t{seq}", 1) for seq in range(2, count + 2)]


def test_a_run_its_owner_finished_replays_with_the_owners_numbering() -> None:
    # started 1, deltas 2..6, usage 7, done 8: the owner stored last_seq 8.
    run = stored_run(
        status=RunStatus.COMPLETED, last_seq=8, finish_reason=FinishReason.STOP, usage=Usage(10, 0, 5)
    )
    events = [
        started_event(run),
        *(merged_delta(d.seq, [(d.text, d.token_count)]) for d in deltas(5)),
        *terminal_events(run, deltas(5), 0),
    ]
    assert [e.seq for e in events] == list(range(1, 9))
    assert events[-2].usage.completion_tokens == 5
    assert events[-1].done.finish_reason == chat_pb2.FINISH_REASON_STOP
    assert events[-1].done.assistant_message_id == "answer-1"
    # A client that saw the usage event gets only the done event.
    assert [e.seq for e in terminal_events(run, deltas(5), 7)] == [8]
    assert terminal_events(run, deltas(5), 8) == []


def test_an_interrupted_run_ends_after_whatever_the_client_saw() -> None:
    # Checkpointed through seq 6; the client had seen seq 9 before the owner was lost.
    run = stored_run(status=RunStatus.INTERRUPTED, last_seq=6, finish_reason=FinishReason.ERROR)
    assert [(e.seq, e.error.code) for e in terminal_events(run, deltas(5), 9)] == [(10, INTERRUPTED_CODE)]
    assert [e.seq for e in terminal_events(run, deltas(5), 3)] == [7]


def test_a_failed_run_without_output_has_no_answer_to_point_to() -> None:
    run = stored_run(status=RunStatus.CANCELLED, last_seq=1, finish_reason=FinishReason.CANCELLED)
    [done] = terminal_events(run, [], 0)
    assert done.seq == 2 and done.done.assistant_message_id == ""


def loaded_pacer(lag_s: float = 0.02, max_interval_s: float = 0.1) -> StreamPacer:
    lag = RecentLag()
    lag.seconds = lag_s
    return StreamPacer(max_interval_s, lag)


async def test_under_load_a_merging_follower_gets_each_delta_it_waited_for_at_once_then_what_gathers() -> (
    None
):
    run = held_run(pacer=loaded_pacer())  # a 40 ms stream interval
    merged = run.follow(0, merge_deltas=True)
    assert described(await anext(merged)) == (1, "started")
    # Deltas 5 ms apart. The first two were waited for: each leaves at once, alone.
    for i in range(2):
        reading = asyncio.ensure_future(anext(merged))
        await asyncio.sleep(0.005)
        run.append_delta(f"t{i}", 1)
        assert described(await asyncio.wait_for(reading, 0.02)) == (i + 2, "delta", f"t{i}", 1)
    # They come faster than the interval: the next ones gather for it, and leave as one at its tick.
    loop = asyncio.get_running_loop()
    reading, sent_at = asyncio.ensure_future(anext(merged)), loop.time()
    for i in range(2, 5):
        await asyncio.sleep(0.005)
        run.append_delta(f"t{i}", 1)
    assert described(await reading) == (6, "delta", "t2t3t4", 3)
    assert loop.time() - sent_at >= 0.035
    # The end waits for no tick: the last delta and the end leave as the run ends.
    reading = asyncio.ensure_future(anext(merged))
    await asyncio.sleep(0.005)
    run.append_delta("t5", 1)
    run.append(done=chat_pb2.Done())
    run.finish(chat_pb2.RUN_STATUS_COMPLETED)
    assert described(await asyncio.wait_for(reading, 0.02)) == (7, "delta", "t5", 1)
    assert [described(e) async for e in merged] == [(8, "done")]


class CountingPacer(StreamPacer):
    def __init__(self, lag_s: float) -> None:
        lag = RecentLag()
        lag.seconds = lag_s
        super().__init__(0.1, lag)
        self.gathered = 0

    async def gather(self, until: Wakeup) -> None:
        self.gathered += 1
        await super().gather(until)


async def test_under_load_deltas_further_apart_than_the_interval_wait_for_no_tick() -> None:
    pacer = CountingPacer(lag_s=0.02)  # 40 ms
    run = held_run(pacer=pacer)
    merged = run.follow(0, merge_deltas=True)
    assert (await anext(merged)).seq == 1
    for i in range(3):  # 50 ms apart: nothing would gather with them
        reading = asyncio.ensure_future(anext(merged))
        await asyncio.sleep(0.05)
        run.append_delta(f"t{i}", 1)
        assert described(await asyncio.wait_for(reading, 0.02)) == (i + 2, "delta", f"t{i}", 1)
    assert pacer.gathered == 0
    # Then two right after the last: they gather for a tick, and leave as one.
    run.append_delta("t3", 1)
    run.append_delta("t4", 1)
    assert described(await anext(merged)) == (6, "delta", "t3t4", 2)
    assert pacer.gathered == 1


async def test_under_load_a_follower_that_asked_for_every_delta_still_gets_each_as_it_is_made() -> None:
    run = held_run(pacer=loaded_pacer())
    each = run.follow(0)
    assert (await anext(each)).seq == 1
    for i in range(3):
        reading = asyncio.ensure_future(anext(each))
        await asyncio.sleep(0.001)
        run.append_delta(f"t{i}", 1)
        assert described(await asyncio.wait_for(reading, 0.02)) == (i + 2, "delta", f"t{i}", 1)


async def test_under_load_a_gathering_follower_of_a_run_handed_over_resumes_elsewhere_at_once() -> None:
    run = held_run(pacer=loaded_pacer(lag_s=0.05))  # 100 ms
    merged = run.follow(0, merge_deltas=True)
    assert (await anext(merged)).seq == 1
    run.append_delta("t0", 1)
    run.append_delta("t1", 1)
    assert described(await anext(merged)) == (3, "delta", "t0t1", 2)
    reading = asyncio.ensure_future(anext(merged))  # gathering for the tick
    await asyncio.sleep(0.005)
    run.append_delta("t2", 1)
    run.hand_over()
    assert described(await asyncio.wait_for(reading, 0.02)) == (4, "delta", "t2", 1)
    with pytest.raises(ServiceError) as caught:
        await asyncio.wait_for(anext(merged), 0.02)
    assert caught.value.code.name == "UNAVAILABLE"


def test_a_run_handed_over_has_not_ended_and_nothing_follows_it() -> None:
    run = held_run()
    run.append(started=chat_pb2.RunStarted(run_id="r1"))
    run.hand_over()
    # It is no longer this replica's, yet it did not end: GetRun elsewhere tells how it ends.
    assert run.state is RunState.HANDED_OVER and run.state.done_here
    assert run.ended_at is None and run.status == chat_pb2.RUN_STATUS_IN_PROGRESS
    with pytest.raises(RuntimeError):
        run.append_delta("late", 1)
    with pytest.raises(RuntimeError):
        run.finish(chat_pb2.RUN_STATUS_COMPLETED)


def test_a_run_ends_once_and_is_never_handed_over_after() -> None:
    run = held_run()
    run.append(started=chat_pb2.RunStarted(run_id="r1"))
    run.finish(chat_pb2.RUN_STATUS_COMPLETED)
    assert run.state is RunState.ENDED and run.ended_at is not None
    run.cancelling()  # a cancel that comes after the end leaves it as it is
    assert run.status == chat_pb2.RUN_STATUS_COMPLETED
    for move in (run.hand_over, lambda: run.finish(chat_pb2.RUN_STATUS_FAILED)):
        with pytest.raises(RuntimeError):
            move()
