"""Tools the orchestrator runs itself (docs/tools.md), through real processes: Cassandra, a router, a
null engine whose text is scripted to be a calculator call (so no test depends on a model choosing to
call a tool), and orchestrator replicas with ``--tools``. A step is two stored, numbered events between
the answer's deltas; the answer goes on after it as a continuation of the same run; a replica killed
around a step leaves it to another, which never runs the tool again and finishes the answer."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.engine.v1 import engine_pb2
from chatmesh.limits import Generation
from chatmesh.model_files import bundled_model_path
from chatmesh.tokenizer import ChatMessage, load_tokenizer
from chatmesh.tool_format import ToolCall, result_text
from memory_store.models import RunDelta
from memory_store.store import MemoryStore
from orchestrator.config import DEFAULT_SYSTEM_PROMPT, ToolConfig
from orchestrator.router_client import start_frame
from orchestrator.runs.tool_steps import started_record
from orchestrator.tools.toolbox import Tool, Toolbox, builtin_tools
from tests.fixtures.in_process import in_process_replica, within
from tests.fixtures.orchestrator import (
    ChatClient,
    Mesh,
    MeshFactory,
    OrchestratorProcess,
    collect,
    events,
    kinds,
)
from tests.memory_store.builders import start_run

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
TOOL_FLAGS = {"tools": True, "tool_max_steps": 1}
FAST_REAPING = {"heartbeat_interval_s": 0.5, "orphan_after_s": 2.0, "reap_interval_s": 0.5}
OPTIONS = chat_pb2.GenerationOptions(max_tokens=48, temperature=0.0)
TOKENIZER = load_tokenizer(str(bundled_model_path()))
CALL_TOKENS = len(TOKENIZER.encode(CALL))


def aligned_prompt(text: str) -> list[int]:
    """The prompt of a new chat's first message ``aligned_question(text)``."""
    return TOKENIZER.encode_chat([_system(), ChatMessage("user", aligned_question(text))])


def _system() -> ChatMessage:
    tools = Toolbox(ToolConfig(enabled=True), builtin_tools(None), ("free", "pro", "enterprise")).tools_for(
        "pro", 0
    )  # type: ignore[arg-type]
    assert tools is not None
    return ChatMessage("system", f"{DEFAULT_SYSTEM_PROMPT}\n\n{tools.system_text()}")


def aligned_question(text: str) -> str:
    """``text`` padded so that the prompt of a new chat's first message is a whole number of the null
    engine's cycles: the engine's text at a position is its cycle's token there, so the answer then
    starts with the call (the prompt the orchestrator assembles: its system prompt, the tools, the
    question)."""
    system = _system()
    for pad in range(4 * CALL_TOKENS):
        question = text + " a" * pad
        if len(TOKENIZER.encode_chat([system, ChatMessage("user", question)])) % CALL_TOKENS == 0:
            return question
    raise AssertionError("no padding aligns the prompt with the null engine's cycle")


@pytest.fixture(scope="module")
def tool_mesh(start_mesh: MeshFactory) -> Iterator[Mesh]:
    mesh = start_mesh(
        1, "null", engine_flags={"null_tokens_per_s": 40, "null_text": CALL}, **TOOL_FLAGS, **FAST_REAPING
    )
    yield mesh
    for replica in list(mesh.orchestrators):
        mesh.stop_orchestrator(replica)


def assert_one_step_between_deltas(
    run: list[chat_pb2.RunEvent],
) -> tuple[chat_pb2.ToolStepStarted, chat_pb2.ToolStepResult]:
    assert [event.seq for event in run] == list(range(1, len(run) + 1)), "a gap or a duplicate"
    seen = kinds(run)
    assert seen.count("step_started") == 1 and seen.count("step_result") == 1, seen
    # The call's text is in no delta: the answer is what follows the step.
    assert seen[1:3] == ["step_started", "step_result"] and "delta" in seen[3:], seen
    at = 1
    assert seen[-2:] == ["usage", "done"], seen
    started, result = run[at].step_started, run[at + 1].step_result
    assert started.tool == result.tool == "calculator" and started.call_id == result.call_id
    return started, result


async def test_a_tool_call_is_a_stored_step_and_the_answer_goes_on_after_it(
    tool_mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    replica = tool_mesh.orchestrator
    client = connect(replica.address)
    ran = await replica.counted("chatmesh_orchestrator_tool_calls", tool="calculator", outcome="ok")
    chat = await client.create_chat("tools")
    run = await collect(client.send(chat.chat_id, aligned_question("What is 6 * 7?"), options=OPTIONS))

    started, result = assert_one_step_between_deltas(run)
    assert started.arguments == '{"expression": "6 * 7"}'
    assert (result.outcome, result.text) == (chat_pb2.TOOL_OUTCOME_OK, "42")
    assert (
        await replica.counted("chatmesh_orchestrator_tool_calls", tool="calculator", outcome="ok") == ran + 1
    )
    text = "".join(e.delta.text for e in run if e.HasField("delta"))
    # Both turns' prompts are charged (the second holds the first, its call and the result).
    usage = run[-2].usage
    first = len(aligned_prompt("What is 6 * 7?"))
    second = first + CALL_TOKENS + len(TOKENIZER.user_turn_after_answer(result_text("42")))
    assert (usage.prompt_tokens, usage.completion_tokens) == (first + second, OPTIONS.max_tokens)

    # Any replica replays it from Cassandra, steps in place; the answer stored is the streamed text.
    with tool_mesh.replica(**TOOL_FLAGS, **FAST_REAPING) as other:
        replayed = await collect(connect(other.address, client.user).stream_run(run[0].started.run_id))
    assert [e for e in replayed if not e.HasField("delta")] == [e for e in run if not e.HasField("delta")]
    assert "".join(e.delta.text for e in replayed if e.HasField("delta")) == text
    messages = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert messages.messages[0].content == text


async def test_the_turn_after_a_step_needs_room_in_the_budget_for_its_prompt(
    tool_mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    """The run's reservation holds its first prompt and max_tokens; the next turn's prompt (the first,
    the call, the result) is more, and a budget one token short of it ends the answer after the step."""
    question = "Is 6 * 7 42?"
    first = len(aligned_prompt(question))
    second = first + CALL_TOKENS + len(TOKENIZER.user_turn_after_answer(result_text("42")))
    budget = first + OPTIONS.max_tokens + second - 1
    with tool_mesh.replica(**TOOL_FLAGS, **FAST_REAPING, budget_pro_tokens=budget) as replica:
        client = connect(replica.address)
        chat = await client.create_chat("a tight budget")
        run = await collect(client.send(chat.chat_id, aligned_question(question), options=OPTIONS))
    assert kinds(run) == ["started", "step_started", "step_result", "error"], kinds(run)
    assert run[-1].error.code == "RESOURCE_EXHAUSTED" and "after a tool step" in run[-1].error.message


async def test_a_replica_killed_at_a_tool_step_leaves_it_to_another_which_never_runs_it_again(
    tool_mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    survivor = tool_mesh.orchestrator
    victim = tool_mesh.start_orchestrator(**TOOL_FLAGS, **FAST_REAPING)
    on_victim = connect(victim.address)
    chat = await on_victim.create_chat("killed at a step")
    ran_on_survivor = await survivor.counted(
        "chatmesh_orchestrator_tool_calls", tool="calculator", outcome="ok"
    )

    seen: list[chat_pb2.RunEvent] = []
    async for event in events(on_victim.send(chat.chat_id, aligned_question("And 6 * 7?"), options=OPTIONS)):
        seen.append(event)
        if event.HasField("step_started"):
            break  # stored before the tool runs: kill the replica now, around the tool's run
    kill(tool_mesh, victim)

    rest = await asyncio.wait_for(
        collect(connect(survivor.address, on_victim.user).stream_run(seen[0].started.run_id, seen[-1].seq)),
        60,
    )
    _, result = assert_one_step_between_deltas(seen + rest)
    # The victim ran it (its result stored) or was killed before: then the survivor says so, never runs it.
    assert result.outcome in (chat_pb2.TOOL_OUTCOME_OK, chat_pb2.TOOL_OUTCOME_INTERRUPTED)
    assert (
        await survivor.counted("chatmesh_orchestrator_tool_calls", tool="calculator", outcome="ok")
        == ran_on_survivor
    )
    assert rest[-1].done.assistant_message_id


async def test_a_step_found_started_without_its_result_is_answered_interrupted_never_run_again(
    tool_mesh: Mesh, connect: Callable[..., ChatClient], memory_store: MemoryStore
) -> None:
    """The lost replica stored the call and its step started, then died: whether its tool ran is not
    known. The adopter (a replica in this process, its calculator a seam that would block) stores the
    result "interrupted", never calls the tool, and finishes the answer after it."""
    client = connect(tool_mesh.orchestrator.address)
    tools = ToolConfig(enabled=True, max_steps=1)
    async with in_process_replica(memory_store, tool_mesh.router_address, tools=tools) as replica:
        toolbox = replica.parts.ctx.runs.deps.toolbox
        assert toolbox is not None
        called = asyncio.Event()

        async def blocks(_user: str, _arguments: dict[str, Any]) -> str:
            called.set()
            await asyncio.Event().wait()
            return ""

        toolbox.tools["calculator"] = Tool(toolbox.tools["calculator"].function, blocks)
        offered = toolbox.tools_for("pro", 0)
        assert offered is not None
        chat = await client.create_chat("adopted at a step")
        lost = f"lost-{uuid.uuid4().hex[:6]}"
        await memory_store.heartbeat_replica(lost, group=replica.parts.membership.group)
        ctx = replica.parts.ctx
        options = Generation(ctx.models.default, 48, 0.0, 0.0, None, ())
        grammar = engine_pb2.StructuredOutput(grammar=offered.constraint().grammar)
        generation = start_frame(
            str(uuid.uuid4()),
            TOKENIZER.encode_chat([ChatMessage("user", "What is 6 * 7?")]),
            dataclasses.replace(options, structured=grammar),
            "pro",
            chat.chat_id,
            TOKENIZER.fingerprint,
        )
        run, _ = await start_run(
            memory_store,
            client.user,
            chat.chat_id,
            "What is 6 * 7?",
            owner=lost,
            generation=generation.SerializeToString(),
        )
        call_ids = tuple(TOKENIZER.encode(CALL))
        call = ToolCall("call_lost", "calculator", '{"expression": "6 * 7"}')
        step = started_record(call, lost)
        assert await memory_store.store_step(run, RunDelta(2, "", len(call_ids), call_ids, step)) == step

        assert await within(replica.runs.adoptions.adopt(run, lost), 30, "the replica did not adopt the run")
        streamed = [event async for event in replica.runs.reads.stream(client.user, run.run_id, 0)]
        assert [event.seq for event in streamed] == list(range(1, len(streamed) + 1))
        assert kinds(streamed)[:3] == ["started", "step_started", "step_result"]
        result = streamed[2].step_result
        assert (result.call_id, result.outcome) == ("call_lost", chat_pb2.TOOL_OUTCOME_INTERRUPTED)
        assert "not run again" in result.text
        assert kinds(streamed)[3] == "delta" and kinds(streamed)[-2:] == ["usage", "done"]
        assert not called.is_set(), "the tool ran again"
        # The result is stored: any replica replays the same events.
        replayed = await collect(client.stream_run(run.run_id))
        assert [e for e in replayed if not e.HasField("delta")] == [
            e for e in streamed if not e.HasField("delta")
        ]


def kill(mesh: Mesh, victim: OrchestratorProcess) -> None:
    mesh.launcher.signal(victim.name, signal.SIGKILL)
    mesh.launcher.forget(victim.name)
    mesh.orchestrators.remove(victim)
