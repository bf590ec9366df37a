"""A stored chat's tool steps on its SSE stream (edge/convert.py:event_json): each step event is an SSE
event of its own kind, its data the step's fields, the outcome named as docs/tools.md names it."""

from __future__ import annotations

import json

from chatmesh.chat.v1 import chat_pb2
from edge.sse import run_event_sse


def _sent(event: chat_pb2.RunEvent) -> tuple[str, dict]:
    lines = run_event_sse(event).encode().decode().split("\r\n")
    assert lines[0] == f"id: {event.seq}"
    return lines[1].removeprefix("event: "), json.loads(lines[2].removeprefix("data: "))


def test_a_step_started_names_the_call():
    started = chat_pb2.ToolStepStarted(
        call_id="call_1", tool="calculator", arguments='{"expression": "6 * 7"}'
    )
    assert _sent(chat_pb2.RunEvent(seq=2, step_started=started)) == (
        "step_started",
        {"call_id": "call_1", "tool": "calculator", "arguments": '{"expression": "6 * 7"}'},
    )


def test_a_step_result_names_its_outcome():
    for outcome, name in [
        (chat_pb2.TOOL_OUTCOME_OK, "ok"),
        (chat_pb2.TOOL_OUTCOME_TIMEOUT, "timeout"),
        (chat_pb2.TOOL_OUTCOME_INTERRUPTED, "interrupted"),
    ]:
        result = chat_pb2.ToolStepResult(call_id="call_1", tool="clock", outcome=outcome, text="<|im_end|>")
        assert _sent(chat_pb2.RunEvent(seq=3, step_result=result)) == (
            "step_result",
            {"call_id": "call_1", "tool": "clock", "outcome": name, "text": "<|im_end|>"},
        )
