"""Tool results a caller gives back to a stored chat (SendMessage.tool_results), through a real
orchestrator, router, engine and Cassandra: checked against the calls of the message they follow, each
stored as a tool message, once, however often a keyed send is retried."""

from __future__ import annotations

import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tool_format import ToolCall
from memory_store.ids import new_id
from memory_store.models import Message, Role
from memory_store.store import MemoryStore
from tests.fixtures.orchestrator import ChatClient, collect
from tests.orchestrator.test_limits import bad_field, refused

pytestmark = pytest.mark.usefixtures("router_required")

CALLS = (ToolCall("call_a", "get_weather", '{"city": "Paris"}'), ToolCall("call_b", "get_time", "{}"))


def result(call_id: str, content: str = "ok") -> chat_pb2.ToolResult:
    return chat_pb2.ToolResult(tool_call_id=call_id, content=content)


async def test_tool_results_answer_the_calls_they_follow_and_a_retry_stores_them_once(
    client: ChatClient, memory_store: MemoryStore
) -> None:
    chat = await client.create_chat("caller tools")
    asked = Message(str(new_id()), chat.chat_id, Role.USER, "Weather and time in Paris?")
    await memory_store.append_message(client.user, asked)
    calling = Message(str(new_id()), chat.chat_id, Role.ASSISTANT, "", asked.message_id, tool_calls=CALLS)
    await memory_store.append_message(client.user, calling)

    refusals = [
        ([result("call_a")], "tool_results"),  # call_b left without its result
        ([result("call_x"), result("call_b")], "tool_results[0].tool_call_id"),
        ([result("call_a"), result("call_a")], "tool_results[1].tool_call_id"),
    ]
    for results, field in refusals:
        error = await refused(client.send(chat.chat_id, "", tool_results=results))
        assert bad_field(error) == field, error.details()
    # Results for a message that calls nothing, content beside results, results on a new root.
    error = await refused(
        client.send(chat.chat_id, "", tool_results=[result("call_a")], parent_message_id=asked.message_id)
    )
    assert bad_field(error) == "tool_results[0].tool_call_id" and "none" in (error.details() or "")
    error = await refused(client.send(chat.chat_id, "hi", tool_results=[result("call_a")]))
    assert bad_field(error) == "content"
    error = await refused(
        client.send(chat.chat_id, "", tool_results=[result("call_a")], branch_from_root=True)
    )
    assert bad_field(error) == "tool_results"
    assert len((await memory_store.list_messages(client.user, chat.chat_id)).items) == 2, "nothing stored"

    results = [result("call_b", "09:41"), result("call_a", "")]  # any order; a result may be empty
    first = await collect(client.send(chat.chat_id, "", tool_results=results, idempotency_key="results-1"))
    again = await collect(client.send(chat.chat_id, "", tool_results=results, idempotency_key="results-1"))
    assert first[0].started.run_id == again[0].started.run_id, "the retry joined the run"
    listed = (await memory_store.list_messages(client.user, chat.chat_id)).items[::-1]
    assert [m.role for m in listed] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.TOOL, Role.ASSISTANT]
    _, _, time_result, weather_result, answer = listed
    assert (time_result.tool_call_id, time_result.tool_name, time_result.content) == (
        "call_b",
        "get_time",
        "09:41",
    )
    assert (weather_result.tool_call_id, weather_result.tool_name, weather_result.content) == (
        "call_a",
        "get_weather",
        "",
    )
    assert time_result.parent_id == calling.message_id and weather_result.parent_id == time_result.message_id
    assert answer.parent_id == weather_result.message_id
    assert first[0].started.user_message_id == weather_result.message_id
    assert time_result.token_count > 0 and weather_result.token_count > 0
