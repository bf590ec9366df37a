"""Tool calls and results as messages of a stored chat, against a real Cassandra: an answer in the
tool-call format is stored as its calls, a send's tool results as tool messages chained after it, and
both read back by every listing and branch."""

from __future__ import annotations

import dataclasses

import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.finish import FinishReason, Usage
from chatmesh.router.v1 import router_pb2
from chatmesh.tool_format import Function, ToolCall, Tools, parse_answer
from memory_store.errors import InvalidArgument
from memory_store.ids import id_before, parse_id
from memory_store.models import Message, NewRun, Role, RunDelta, RunOutcome, RunStatus
from tests.memory_store.builders import message, new_user, start_run

CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)

# The request of a run constrained to tool calls its caller runs (as the Responses API's tools make it).
CALLER_TOOLS = Tools((Function("get_weather"), Function("get_time")), "auto", parallel=True)
CALLER_TOOLS_REQUEST = router_pb2.GenerateStart(
    request_id="r",
    sampling=engine_pb2.SamplingParams(
        structured=engine_pb2.StructuredOutput(grammar=CALLER_TOOLS.constraint().grammar)
    ),
).SerializeToString()


def tool_message(chat_id: str, message_id: str, parent_id: str, call: ToolCall, content: str) -> Message:
    return Message(
        message_id,
        chat_id,
        Role.TOOL,
        content,
        parent_id=parent_id,
        token_count=5,
        tool_call_id=call.id,
        tool_name=call.name,
    )


async def test_an_answer_of_calls_and_the_results_given_back_are_messages_of_the_branch(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "tools")
    tail = tuple(RunDelta(2 + i, CALLS[i * 40 : (i + 1) * 40], 1) for i in range(len(CALLS) // 40 + 1))
    outcome = RunOutcome(
        RunStatus.COMPLETED, 2 + len(tail) - 1, FinishReason.STOP, tail=tail, usage=Usage(9, 0, 30)
    )
    # An answer that only looks like calls (its run was not constrained to the caller's tools: no tools,
    # or the orchestrator's own, whose calls are steps) is stored as the text that was streamed.
    other = await memory_store.create_chat(user, "no tools")
    run, _ = await start_run(memory_store, user, other.chat_id, "Say it in the tool format")
    text = (await memory_store.finish_run(run, outcome, list(tail))).message
    assert text is not None and (text.content, text.tool_calls) == (CALLS, ())

    run, asked = await start_run(
        memory_store, user, chat.chat_id, "Weather and time in Paris?", generation=CALLER_TOOLS_REQUEST
    )
    answer = (await memory_store.finish_run(run, outcome, list(tail))).message
    assert answer is not None
    _, calls = parse_answer(CALLS, run.run_id)
    assert answer.content == "" and list(answer.tool_calls) == calls, "the Responses API's ids"
    assert [c.name for c in calls] == ["get_weather", "get_time"]

    # A send of the two results: two tool messages, the second the run's question.
    claim = await memory_store.claim_idempotency_key(user, "results", b"fingerprint")
    last_id = claim.user_message_id
    first_id = str(id_before(parse_id(last_id, "id"), 1))
    first = tool_message(chat.chat_id, first_id, answer.message_id, calls[0], '{"sky": "clear"}')
    last = tool_message(chat.chat_id, last_id, first_id, calls[1], "09:41")
    new = NewRun(
        user,
        chat.chat_id,
        run_id=claim.run_id,
        parent_message_id=last_id,
        assistant_message_id=claim.assistant_message_id,
        model="smollm2-135m",
        owner_id="replica-a",
        user_message_id=last_id,
    )
    branch_chat = (await memory_store.get_branch(user, chat.chat_id, None)).chat
    # Results that do not follow one another: refused, nothing stored.
    stray = dataclasses.replace(last, parent_id=answer.message_id)
    with pytest.raises(InvalidArgument, match="follows the one before it"):
        await memory_store.create_run_with_question(new, stray, branch_chat, before=[first])
    # A user message among them: refused.
    with pytest.raises(InvalidArgument, match="one user message, or with tool messages"):
        await memory_store.create_run_with_question(
            new, last, branch_chat, before=[dataclasses.replace(first, role=Role.USER, tool_call_id=None)]
        )
    assert len((await memory_store.list_messages(user, chat.chat_id)).items) == 2

    second = await memory_store.create_run_with_question(new, last, branch_chat, before=[first])
    branch = await memory_store.get_branch(user, chat.chat_id, None)
    assert [m.role for m in branch.messages] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.TOOL]
    stored_first, stored_last = branch.messages[2:]
    assert stored_first == first and stored_last == last, "every field read back as written"
    assert second.user_message_id == last_id
    listed = (await memory_store.list_messages(user, chat.chat_id)).items
    assert [m.message_id for m in listed] == [last_id, first_id, answer.message_id, asked.message_id]
    page = await memory_store.branch_page(user, chat.chat_id, None, None)
    assert [m.tool_call_id for m in page.items[:2]] == [calls[1].id, calls[0].id]


async def test_only_an_answer_calls_tools_and_only_a_tool_message_names_a_call(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "refusals")
    asked = await memory_store.append_message(user, message(chat.chat_id, "hi"))
    call = ToolCall("call_1", "get_time", "{}")
    calling_user = dataclasses.replace(message(chat.chat_id, "hello", asked), tool_calls=(call,))
    with pytest.raises(InvalidArgument, match="only an assistant message calls tools"):
        await memory_store.append_message(user, calling_user)
    nameless = message(chat.chat_id, "09:41", asked, role=Role.TOOL)
    with pytest.raises(InvalidArgument, match="names the call it answers"):
        await memory_store.append_message(user, nameless)
    named_user = dataclasses.replace(message(chat.chat_id, "hello", asked), tool_call_id="call_1")
    with pytest.raises(InvalidArgument, match="names the call it answers"):
        await memory_store.append_message(user, named_user)
    assert [m.content for m in (await memory_store.list_messages(user, chat.chat_id)).items] == ["hi"]
