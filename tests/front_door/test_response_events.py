"""The Responses API's objects and stream events as pure functions of a run's events (no services: the
end-to-end behaviour is in test_mesh_responses.py)."""

from __future__ import annotations

import uuid

import pytest

from chatmesh.chat.v1 import chat_pb2
from edge.errors import ApiError
from edge.response_events import ResponseEvents
from edge.response_record import ResponseRecord, response_id, run_id_of

RUN_ID = str(uuid.uuid1())
MESSAGE_ID = str(uuid.uuid1())


def run_events(*ending: chat_pb2.RunEvent) -> list[chat_pb2.RunEvent]:
    started = chat_pb2.RunStarted(run_id=RUN_ID, chat_id="c", assistant_message_id=MESSAGE_ID, model="m")
    events = [chat_pb2.RunEvent(seq=1, started=started)]
    events += [
        chat_pb2.RunEvent(seq=2 + i, delta=chat_pb2.Delta(text=t)) for i, t in enumerate(["He", "llo"])
    ]
    return events + [chat_pb2.RunEvent(seq=4 + i, **e) for i, e in enumerate(ending)]


def done(reason: chat_pb2.FinishReason) -> list[dict]:
    usage = chat_pb2.Usage(prompt_tokens=7, cached_prompt_tokens=3, completion_tokens=2)
    return [{"usage": usage}, {"done": chat_pb2.Done(finish_reason=reason)}]


def stream(events: list[chat_pb2.RunEvent], starting_after: int = -1) -> list[dict]:
    writer = ResponseEvents(ResponseRecord(created_at=1.0), starting_after)
    return [b for e in events for b in writer.events(e) if b["sequence_number"] > starting_after]


def test_a_finished_run_is_the_whole_event_sequence_numbered_from_zero():
    events = stream(run_events(*done(chat_pb2.FINISH_REASON_STOP)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(10))
    assert events[0]["response"]["output"] == [] and events[0]["response"]["status"] == "in_progress"
    final = events[-1]["response"]
    assert final["id"] == response_id(RUN_ID) and final["model"] == "m"
    assert final["output"][0]["id"] == "msg_" + uuid.UUID(MESSAGE_ID).hex
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["output"][0]["status"] == "completed"
    assert final["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 3},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 9,
    }


def test_resuming_after_n_gives_exactly_the_events_after_n():
    events = run_events(*done(chat_pb2.FINISH_REASON_STOP))
    whole = stream(events)
    for n in range(-1, len(whole)):
        assert stream(events, n) == whole[n + 1 :]


@pytest.mark.parametrize(
    ("reason", "status", "incomplete", "terminal"),
    [
        (chat_pb2.FINISH_REASON_LENGTH, "incomplete", "max_output_tokens", "response.incomplete"),
        (chat_pb2.FINISH_REASON_CONTENT_FILTER, "incomplete", "content_filter", "response.incomplete"),
        (chat_pb2.FINISH_REASON_CANCELLED, "cancelled", None, "response.incomplete"),
    ],
)
def test_how_a_run_ended_is_the_responses_status(reason, status, incomplete, terminal):
    last = stream(run_events(*done(reason)))[-1]
    assert last["type"] == terminal and last["response"]["status"] == status
    details = last["response"]["incomplete_details"]
    assert (details and details["reason"]) == incomplete
    assert last["response"]["output"][0]["status"] == "incomplete"


def test_a_failed_run_is_a_failed_response_keeping_its_text():
    error = chat_pb2.RunError(code="RESOURCE_EXHAUSTED", message="budget spent")
    events = stream(run_events({"error": error}))
    assert [e["type"] for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    final = events[-1]["response"]
    assert final["status"] == "failed" and final["usage"] is None
    assert final["error"] == {"code": "rate_limit_exceeded", "message": "budget spent"}
    assert final["output"][0]["content"][0]["text"] == "Hello"


def test_a_broken_stream_says_where_to_resume():
    writer = ResponseEvents(ResponseRecord())
    for event in run_events()[:2]:
        writer.events(event)
    [sse] = writer.error(ApiError(503, "gone", code="unavailable"))
    assert sse.event == "error" and '"sequence_number":4' in str(sse.data)  # the last one sent


def test_response_ids_name_runs_and_nothing_else():
    assert run_id_of(response_id(RUN_ID), None) == RUN_ID
    for bad in ("resp_nope", "chatcmpl-1", "resp_" + uuid.uuid4().hex, uuid.UUID(RUN_ID).hex):
        with pytest.raises(ApiError) as refused:
            run_id_of(bad, "previous_response_id")
        assert refused.value.status == 404 and refused.value.param == "previous_response_id"


CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def answer_events(text: str, cut: int, *ending: dict) -> list[chat_pb2.RunEvent]:
    started = chat_pb2.RunStarted(run_id=RUN_ID, chat_id="c", assistant_message_id=MESSAGE_ID, model="m")
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    events = [chat_pb2.RunEvent(seq=1, started=started)]
    events += [chat_pb2.RunEvent(seq=2 + i, delta=chat_pb2.Delta(text=t)) for i, t in enumerate(pieces)]
    return events + [chat_pb2.RunEvent(seq=2 + len(pieces) + i, **e) for i, e in enumerate(ending)]


@pytest.mark.parametrize("cut", [1, 4, 9, 500])
def test_an_answer_of_tool_calls_streams_as_function_call_items_however_it_is_cut(cut):
    events = answer_events(CALLS, cut, *done(chat_pb2.FINISH_REASON_STOP))
    whole = stream(events)
    call_events = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["type"] for e in whole] == [
        "response.created",
        "response.in_progress",
        *call_events,
        *call_events,
        "response.completed",
    ]
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    final = whole[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["function_call", "function_call"]
    added = [e for e in whole if e["type"] == "response.output_item.added"]
    finished = [e for e in whole if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [0, 1]
    assert [e["item"]["arguments"] for e in added] == ["", ""]
    assert [e["item"]["id"] for e in added] == [item["id"] for item in final], "the same items as output"
    assert [e["item"] for e in finished] == final
    deltas = [e for e in whole if e["type"] == "response.function_call_arguments.delta"]
    assert [e["delta"] for e in deltas] == ['{"city": "Paris"}', "{}"]
    assert [e["item_id"] for e in deltas] == [item["id"] for item in final]
    for n in range(-1, len(whole)):
        assert stream(events, n) == whole[n + 1 :]


def test_a_call_cut_by_max_tokens_ends_as_text_after_the_calls_before_it():
    first_call = CALLS.split("\n")[0]
    cut_text = '<tool_call>{"name": "get_time", "argu'
    events = answer_events(f"{first_call}\n{cut_text}", 7, *done(chat_pb2.FINISH_REASON_LENGTH))
    whole = stream(events)
    final = whole[-1]["response"]
    assert whole[-1]["type"] == "response.incomplete"
    assert [item["type"] for item in final["output"]] == ["function_call", "message"]
    [text_delta] = [e for e in whole if e["type"] == "response.output_text.delta"]
    assert text_delta["output_index"] == 1 and text_delta["delta"] == cut_text
    [text_done] = [e for e in whole if e["type"] == "response.output_text.done"]
    assert text_done["text"] == cut_text == final["output"][1]["content"][0]["text"]


def test_text_that_starts_like_a_call_is_released_once_it_cannot_be_one():
    events = answer_events("<b>bold</b>", 1, *done(chat_pb2.FINISH_REASON_STOP))
    whole = stream(events)
    deltas = [e["delta"] for e in whole if e["type"] == "response.output_text.delta"]
    assert deltas[0] == "<b" and "".join(deltas) == "<b>bold</b>"
    assert whole[-1]["response"]["output"][0]["content"][0]["text"] == "<b>bold</b>"


def test_an_answer_with_no_text_still_has_its_message():
    whole = stream(answer_events("", 1, *done(chat_pb2.FINISH_REASON_STOP)))
    assert [e["type"] for e in whole][2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
