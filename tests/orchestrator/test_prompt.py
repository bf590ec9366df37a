"""Prompt fitting with the real tokenizer and chat template (pure logic, no services)."""

from __future__ import annotations

import itertools
import json
import uuid

import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.tokenizer import ChatMessage, EncodedTexts, load_tokenizer
from chatmesh.tool_format import parse_answer, result_text
from memory_store.models import Message, Role
from orchestrator.prompting.history import turns
from orchestrator.prompting.prompt import SUMMARY_HEADING, PromptTooLong, fit_prompt, step_boundaries
from orchestrator.prompting.schema_note import SCHEMA_NOTE, with_schema_shown

SYSTEM = [ChatMessage("system", "You are terse.")]


def conversation(turns: int) -> list[ChatMessage]:
    return [
        ChatMessage(
            "user" if i % 2 == 0 else "assistant", f"turn {i}: " + "words and more words " * (i % 5 + 1)
        )
        for i in range(turns)
    ]


def test_a_history_that_fits_is_kept_verbatim_and_counted_exactly() -> None:
    tokenizer = load_tokenizer()
    turns = conversation(7)
    exact = len(tokenizer.encode_chat(SYSTEM + turns))
    prompt = fit_prompt(tokenizer, SYSTEM, turns, budget=exact)
    assert prompt.history == "verbatim"
    assert prompt.token_ids == tokenizer.encode_chat(SYSTEM + turns)
    assert prompt.turns_kept == 7 and prompt.full_tokens == exact


def test_one_token_less_drops_the_oldest_turns_and_still_fits_exactly() -> None:
    tokenizer = load_tokenizer()
    turns = conversation(9)
    exact = len(tokenizer.encode_chat(SYSTEM + turns))
    prompt = fit_prompt(tokenizer, SYSTEM, turns, budget=exact - 1)
    assert prompt.history == "truncated"
    assert prompt.messages == SYSTEM + turns[9 - prompt.turns_kept :]
    assert len(prompt.token_ids) <= exact - 1
    # The longest fitting suffix: one more turn would not fit.
    one_more = tokenizer.encode_chat(SYSTEM + turns[9 - prompt.turns_kept - 1 :])
    assert len(one_more) > exact - 1


def test_the_summary_goes_into_the_system_message_and_the_newest_turns_fill_the_rest() -> None:
    tokenizer = load_tokenizer()
    turns = conversation(30)
    budget = 300
    prompt = fit_prompt(tokenizer, SYSTEM, turns, budget, summary="They discussed words.")
    assert prompt.summary_used
    assert prompt.messages[0].role == "system"
    assert (
        SUMMARY_HEADING in prompt.messages[0].content
        and "They discussed words." in prompt.messages[0].content
    )
    assert prompt.messages[-1] == turns[-1]
    assert len(prompt.token_ids) <= budget
    assert len(tokenizer.encode_chat(prompt.messages[:1] + turns[30 - prompt.turns_kept - 1 :])) > budget


def test_a_message_that_cannot_fit_even_alone_is_refused() -> None:
    tokenizer = load_tokenizer()
    with pytest.raises(PromptTooLong) as caught:
        fit_prompt(tokenizer, SYSTEM, [ChatMessage("user", "long " * 500)], budget=100)
    assert caught.value.needed > 100 and caught.value.budget == 100


def test_a_summary_too_big_for_the_budget_is_left_out_rather_than_refusing_the_message() -> None:
    tokenizer = load_tokenizer()
    message = ChatMessage("user", "hello")
    alone = len(tokenizer.encode_chat([*SYSTEM, message]))
    prompt = fit_prompt(tokenizer, SYSTEM, [message], budget=alone + 5, summary="summary " * 200)
    assert not prompt.summary_used and prompt.messages == [*SYSTEM, message]


def test_a_growing_chat_cut_in_steps_keeps_its_start_for_many_turns() -> None:
    """Turn after turn the prompt is the previous one plus the new exchange (a cached prefix), until
    the next step boundary; cutting one turn at a time would change the prompt's start every turn."""
    tokenizer = load_tokenizer()
    budget = 400
    step = budget // 3
    starts_stepped, starts_per_turn = [], []
    for length in range(3, 61, 2):
        turns = conversation(length)
        stepped = fit_prompt(tokenizer, SYSTEM, turns, budget, step_tokens=step)
        per_turn = fit_prompt(tokenizer, SYSTEM, turns, budget)
        for prompt in (stepped, per_turn):
            assert len(prompt.token_ids) <= budget and prompt.messages[-1] == turns[-1]
        starts_stepped.append(length - stepped.turns_kept)
        starts_per_turn.append(length - per_turn.turns_kept)
    moves = sum(a != b for a, b in itertools.pairwise(starts_stepped))
    moves_per_turn = sum(a != b for a, b in itertools.pairwise(starts_per_turn))
    assert starts_stepped == sorted(starts_stepped)  # a cut never moves back
    assert moves_per_turn >= 20 and moves <= moves_per_turn // 3


def test_a_stepped_cut_starts_at_a_boundary_and_is_the_longest_such_prompt() -> None:
    tokenizer = load_tokenizer()
    turns = conversation(30)
    budget, step = 300, 100
    prompt = fit_prompt(tokenizer, SYSTEM, turns, budget, step_tokens=step)
    cuts = step_boundaries(tokenizer, turns, step)
    start = len(turns) - prompt.turns_kept
    assert start in cuts
    earlier = [cut for cut in cuts if cut < start]
    if earlier:
        assert len(tokenizer.encode_chat(SYSTEM + turns[earlier[-1] :])) > budget


def test_step_boundaries_depend_only_on_the_turns_before_them() -> None:
    tokenizer = load_tokenizer()
    turns = conversation(40)
    shorter = step_boundaries(tokenizer, turns[:25], 50)
    longer = step_boundaries(tokenizer, turns, 50)
    assert shorter and longer[: len(shorter)] == shorter


def test_a_step_no_boundary_can_satisfy_falls_back_to_the_newest_turns_that_fit() -> None:
    tokenizer = load_tokenizer()
    turns = conversation(12)
    exact = len(tokenizer.encode_chat(SYSTEM + turns))
    # One boundary at most (a step longer than the whole history): the cut is the per-turn one.
    assert fit_prompt(tokenizer, SYSTEM, turns, exact - 1, step_tokens=10**6) == fit_prompt(
        tokenizer, SYSTEM, turns, exact - 1
    )


def test_only_a_prompt_with_nothing_of_the_chat_before_its_message_opens_a_session() -> None:
    tokenizer = load_tokenizer()
    first = fit_prompt(tokenizer, SYSTEM, conversation(1), budget=4096)
    assert first.opens_session  # a chat's first message: the router spreads these by sessions held
    assert not fit_prompt(tokenizer, SYSTEM, conversation(3), budget=4096).opens_session
    # A summary is the chat's past too, even with one verbatim turn left.
    assert not fit_prompt(tokenizer, SYSTEM, conversation(1), budget=4096, summary="earlier").opens_session
    # A long history cut down to its last turn still has a past (cached wherever it last ran).
    cut = fit_prompt(tokenizer, SYSTEM, conversation(9), budget=len(first.token_ids) + 40)
    assert cut.turns_kept < 9 and not cut.opens_session


def record_encodes(monkeypatch, tokenizer) -> list[str]:
    """The texts ``tokenizer.encode`` is asked to encode from now on (until ``monkeypatch.undo()``)."""
    encoded: list[str] = []
    encode = tokenizer.encode

    def recorded(text: str) -> list[int]:
        encoded.append(text)
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", recorded)
    return encoded


def test_fitting_a_long_history_encodes_each_turn_once_whatever_it_tries(monkeypatch) -> None:
    # The search renders many subsets of the turns (the step boundaries, then the newest that fit): a
    # 120-turn chat's prompt cost ~3x as much when each render encoded its turns again.
    tokenizer = load_tokenizer()
    turns = conversation(60)
    budget = len(tokenizer.encode_chat(SYSTEM + turns)) // 3
    encoded = record_encodes(monkeypatch, tokenizer)
    prompt = fit_prompt(tokenizer, SYSTEM, turns, budget, step_tokens=budget // 3)
    monkeypatch.undo()
    assert prompt.history == "truncated" and 1 < prompt.turns_kept < 60
    assert sorted(encoded) == sorted(m.content for m in SYSTEM + turns)
    # ... and the prompt is what its messages encode to, each content encoded anew.
    assert prompt.token_ids == tokenizer.encode_chat(prompt.messages)


def test_a_chat_assembled_again_encodes_only_its_new_turns(monkeypatch) -> None:
    # Every send assembles its chat's prompt again from messages that never change.
    tokenizer = load_tokenizer()
    turns = conversation(41)
    budget = len(tokenizer.encode_chat(SYSTEM + turns)) // 2
    recent = EncodedTexts(max_tokens=100_000)
    first = fit_prompt(tokenizer, SYSTEM, turns[:39], budget, step_tokens=budget // 3, recent=recent)
    encoded = record_encodes(monkeypatch, tokenizer)
    second = fit_prompt(tokenizer, SYSTEM, turns, budget, step_tokens=budget // 3, recent=recent)
    monkeypatch.undo()
    assert first.history == second.history == "truncated"
    assert encoded == [turns[39].content, turns[40].content]
    # The same prompt as one assembled from nothing kept.
    assert second == fit_prompt(tokenizer, SYSTEM, turns, budget, step_tokens=budget // 3)


SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}}'


def test_a_json_schema_no_message_shows_is_shown_at_the_end_of_the_system_turn() -> None:
    asked = engine_pb2.StructuredOutput(json_schema=SCHEMA)
    user = [ChatMessage("user", "Describe a person.")]
    shown = with_schema_shown(SYSTEM, user, asked)
    assert shown == [ChatMessage("system", f"You are terse.\n\n{SCHEMA_NOTE}{SCHEMA}")]
    assert with_schema_shown([], user, asked) == [ChatMessage("system", SCHEMA_NOTE + SCHEMA)]
    # Shown by the caller already (as sent or compact), or no schema to show: the system turn as it is.
    pretty = json.dumps(json.loads(SCHEMA), indent=2)
    spelled = [ChatMessage("user", f"Describe a person as {pretty}")]
    assert with_schema_shown(SYSTEM, spelled, engine_pb2.StructuredOutput(json_schema=pretty)) == SYSTEM
    in_system = [ChatMessage("system", f"Follow {SCHEMA}.")]
    assert with_schema_shown(in_system, user, asked) == in_system
    for other in (
        None,
        engine_pb2.StructuredOutput(json_object=True),
        engine_pb2.StructuredOutput(regex="a+"),
    ):
        assert with_schema_shown(SYSTEM, user, other) == SYSTEM


def test_stored_calls_and_results_are_turns_in_the_models_tool_format() -> None:
    written = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    _, calls = parse_answer(written, "run-1")
    chat = "00000000-0000-1000-8000-000000000000"
    ids = [str(uuid.uuid1()) for _ in range(5)]
    messages = [
        Message(ids[0], chat, Role.USER, "Weather and time in Paris?"),
        Message(ids[1], chat, Role.ASSISTANT, "", tool_calls=tuple(calls)),
        Message(
            ids[2], chat, Role.TOOL, '{"sky": "clear"}', tool_call_id=calls[0].id, tool_name="get_weather"
        ),
        Message(ids[3], chat, Role.TOOL, "", tool_call_id=calls[1].id, tool_name="get_time"),
        Message(ids[4], chat, Role.ASSISTANT, ""),  # an answer with no text and no call (filtered)
    ]
    assert turns(messages) == [
        ChatMessage("user", "Weather and time in Paris?"),
        ChatMessage("assistant", written),  # byte for byte what the model wrote: its prefix is cached
        ChatMessage("user", result_text('{"sky": "clear"}')),
        ChatMessage("user", result_text("")),
    ]
