"""A run's tool loop reserves its budget turn by turn (docs/tools.md, "Budget"), through real processes:
Cassandra, a router, a null engine whose text is a calculator call followed by filler as long as the
result's turn (``localmesh.chaos.tool_load``: each turn after a step calls again while offered the
tools), and an orchestrator with ``--tools``. The one-step case, a turn refused for its prompt, is in
test_tool_steps.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tool_format import result_text
from localmesh.chaos.tool_load import CALL, RESULT, aligned_question, first_prompt, null_text, tokenizer
from memory_store.store import MemoryStore
from tests.fixtures.orchestrator import ChatClient, Mesh, MeshFactory, collect, kinds

QUESTION = aligned_question("Is 6 * 7 still 42?", "pro")
OPTIONS = chat_pb2.GenerationOptions(max_tokens=96, temperature=0.0)  # two calls (31 tokens each) fit
# Each turn's prompt: the one before it, the call, and the result's turn.
FIRST = len(first_prompt(QUESTION, "pro"))
STEP = len(tokenizer().encode(CALL)) + len(tokenizer().user_turn_after_answer(result_text(RESULT)))
SECOND, THIRD = FIRST + STEP, FIRST + 2 * STEP
# Room for the first prompt, max_tokens and the second turn's prompt, then the third's, each alone, but
# not for both: a loop reserving only its first turn would pass every check and end past it.
BUDGET = FIRST + OPTIONS.max_tokens + SECOND + THIRD - 1


@pytest.fixture(scope="module")
def budget_mesh(start_mesh: MeshFactory) -> Iterator[Mesh]:
    mesh = start_mesh(
        1,
        "null",
        engine_flags={"null_tokens_per_s": 40, "null_text": null_text()},
        tools=True,
        tool_max_steps=2,
        budget_pro_tokens=BUDGET,
    )
    yield mesh
    for replica in list(mesh.orchestrators):
        mesh.stop_orchestrator(replica)


async def test_each_turn_after_a_step_raises_the_runs_reservation_so_a_tool_loop_cannot_overshoot(
    budget_mesh: Mesh, connect: Callable[..., ChatClient], memory_store: MemoryStore
) -> None:
    """The second turn's prompt is reserved once it is placed, so the third's is refused: the answer
    ends after the second step with the error a send refused by the budget gets, stored, and the user
    is charged what the run used, within the budget."""
    client = connect(budget_mesh.orchestrator.address)
    chat = await client.create_chat("two steps, a tight budget")
    run = await collect(client.send(chat.chat_id, QUESTION, options=OPTIONS))
    assert kinds(run) == ["started", *["step_started", "step_result"] * 2, "error"], kinds(run)
    error = run[-1].error
    assert error.code == "RESOURCE_EXHAUSTED" and "after a tool step" in error.message
    assert error.retry_after_ms > 0  # the window's end, as for a refused send

    # Stored: another replica replays the steps and the same end from Cassandra.
    with budget_mesh.replica(tools=True, tool_max_steps=2) as other:
        replayed = await collect(connect(other.address, client.user).stream_run(run[0].started.run_id))
    assert [(e.seq, e.WhichOneof("kind")) for e in replayed] == [(e.seq, e.WhichOneof("kind")) for e in run]
    assert (replayed[-1].error.code, replayed[-1].error.message) == (error.code, error.message)
    window = await memory_store.get_usage(client.user)
    assert window.runs == 1 and window.usage.prompt_tokens == FIRST + SECOND
    assert window.usage.total_tokens <= BUDGET
