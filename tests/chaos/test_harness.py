"""The chaos suite's own parts, without a mesh: the delay proxy over real loopback sockets, what an answer
counts as (gaps, duplicates), stored against streamed, and which fault an answer is counted for."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from localmesh.chaos.clients import Answer, StepEvent
from localmesh.chaos.delay_proxy import DelayProxies, DelayProxy
from localmesh.chaos.faults import Fault, Injection
from localmesh.chaos.load import tool_count
from localmesh.chaos.report import BASELINE, ToolRecord, tabulate
from localmesh.chaos.tool_load import executions
from meshkit.launcher import free_port


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(port: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    began = time.monotonic()
    writer.write(b"ping")
    await writer.drain()
    assert await reader.readexactly(4) == b"ping"
    elapsed = time.monotonic() - began
    # Our end of the stream closes the proxy's two connections, and the echo server's: all end here.
    writer.write_eof()
    assert await reader.read() == b""
    writer.close()
    return elapsed


async def test_the_delay_proxy_adds_its_delay_each_way_and_none_when_it_is_off():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    upstream = server.sockets[0].getsockname()[1]
    proxies = DelayProxies([DelayProxy("echo", free_port(), upstream)])
    port = proxies.by_name["echo"].port
    try:
        assert await _round_trip(port) < 0.1
        proxies.set_delay("echo", 0.15)
        assert await _round_trip(port) >= 0.3  # 0.15 s there and 0.15 s back
        proxies.set_delay("echo", 0.0)
        assert await _round_trip(port) < 0.1
    finally:
        proxies.close()
        server.close()


def answer(sent_at: float, ended_at: float, seqs: list[int], text: str = "hi", **fields: object) -> Answer:
    record = Answer("u", "c", sent_at, run_id=f"run-{sent_at}", text=text, ended_at=ended_at, **fields)
    record.seqs = Counter(seqs)
    return record


def test_an_answer_counts_missing_and_repeated_sequence_numbers():
    record = answer(0, 1, [1, 2, 2, 4, 5, 5, 5], outcome="done")
    assert (record.gaps, record.duplicates, record.completed) == (1, 3, True)


def test_a_merged_delta_stands_for_the_sequence_numbers_since_the_event_before_it():
    record = Answer("u", "c", 0.0)
    for name, seq, after in [("started", 1, 0), ("delta", 4, 1), ("delta", 5, 4)]:
        record.got(name, seq, after)
    # The stream broke; resumed after 5, and the run numbered the deltas waiting 6 to 9 as one.
    for name, seq, after in [("delta", 9, 5), ("usage", 10, 9), ("done", 11, 10)]:
        record.got(name, seq, after)
    assert (record.last_seq, record.gaps, record.duplicates) == (11, 0, 0)
    # A delta numbered at or before the event before it is a repeat, never a cover of nothing.
    record.got("delta", 9, 11)
    assert record.duplicates == 1
    # Another event after a merged delta must follow it at once: anything skipped is a gap.
    other = Answer("u", "c", 0.0)
    for name, seq, after in [("started", 1, 0), ("delta", 3, 1), ("done", 5, 3)]:
        other.got(name, seq, after)
    assert (other.gaps, other.duplicates) == (1, 0)


def test_an_answer_counts_for_the_first_fault_it_was_open_through():
    kill = Injection(Fault("orchestrator", "kill"), "orchestrator-0", injected_at=10.0)
    pause = Injection(Fault("edge", "pause"), "edge", injected_at=20.0)
    # Open through the kill, ended (reaped) in the pause's window: the kill's.
    victim = answer(9.0, 25.0, [1, 2], outcome="error", error="ABORTED")
    # Sent after the kill, ended before the pause: it ran while the mesh recovered from the kill.
    after = answer(12.0, 14.0, [1, 2, 3], outcome="done")
    before = answer(1.0, 3.0, [1, 2, 3], outcome="done")
    messages = [
        {"role": "assistant", "run_id": after.run_id, "content": "hi", "message_id": "a"},
        {"role": "assistant", "run_id": before.run_id, "content": "hi", "message_id": "b"},
    ]
    rows = {row.kind: row for row in tabulate([kill, pause], [victim, after, before], [], messages)}
    assert (rows["orchestrator kill"].answers, rows["orchestrator kill"].errors) == (2, 1)
    assert rows["orchestrator kill"].error_samples == ["ABORTED"]
    assert rows["edge pause"].answers == 0
    assert (rows[BASELINE].answers, rows[BASELINE].completed) == (1, 1)


def test_stored_is_compared_with_streamed_byte_for_byte_and_acknowledged_messages_must_be_stored():
    same = answer(1.0, 2.0, [1, 2], text="Paris.", outcome="done", user_message_id="m1")
    shorter = answer(1.1, 2.0, [1, 2], text="Paris, France", outcome="error", user_message_id="m2")
    unstored = answer(1.2, 2.0, [1, 2], text="Rome", outcome="done", user_message_id="m3")
    messages = [
        {"role": "user", "message_id": "m1", "content": "q"},
        {"role": "assistant", "run_id": same.run_id, "content": "Paris.", "message_id": "a1"},
        {"role": "user", "message_id": "m2", "content": "q"},
        {"role": "assistant", "run_id": shorter.run_id, "content": "Paris,", "message_id": "a2"},
    ]
    [row] = tabulate([], [same, shorter, unstored], [], messages)
    # "Paris," stored for "Paris, France" streamed; "Rome" completed with nothing stored.
    assert row.stored_differs == 2
    # m3 (acknowledged by its started event) is missing, and so is the completed answer's message.
    assert row.lost == 1


def test_tool_steps_count_executions_repeats_and_step_events_a_stream_missed(tmp_path):
    """Two steps stored; the first's tool ran twice (two audit lines, two replicas' logs), the second's
    was interrupted, never run; the client's stream got past the second step's events without them."""
    first, second = "run-1:0", "run-1:1"
    stored = [
        StepEvent(2, "step_started", first),
        StepEvent(3, "step_result", first, "ok"),
        StepEvent(4, "step_started", second),
        StepEvent(5, "step_result", second, "interrupted"),
    ]
    streamed = answer(0, 1, [1, 2, 3, 4, 5, 6, 7], outcome="done", steps=stored[:2])
    logs = [tmp_path / "orchestrator-0.log", tmp_path / "orchestrator-1.log", tmp_path / "gone.log"]
    line = "2026-12-07 20:00:00,000 INFO orchestrator orchestrator.runs.relay: run r: tool step {} runs calculator\n"
    logs[0].write_text(line.format(first) + "an unrelated line: tool step x\n")
    logs[1].write_text(line.format(first))
    record = ToolRecord({streamed.run_id: stored}, executions(logs))
    assert record.executions == Counter({first: 2})
    [row] = tabulate([], [streamed], [], [], record)
    assert (row.steps, row.ran, row.interrupted, row.twice, row.step_gaps) == (2, 2, 1, 1, 2)


def test_the_tool_share_is_spread_evenly_from_each_users_first_message():
    def tool_questions(share: float) -> list[int]:
        return [n for n in range(1, 13) if tool_count(n, share) > tool_count(n - 1, share)]

    assert tool_questions(0.25) == [1, 5, 9]
    assert tool_questions(0.5) == [1, 3, 5, 7, 9, 11]
    assert tool_questions(0.0) == [] and len(tool_questions(1.0)) == 12
