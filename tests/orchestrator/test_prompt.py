"""Prompt fitting with the real tokenizer and chat template (pure logic, no services)."""

from __future__ import annotations

import pytest

from chatmesh.tokenizer import ChatMessage, load_tokenizer
from orchestrator.prompting.prompt import SUMMARY_HEADING, PromptTooLong, fit_prompt

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
