"""Stored token counts are of one tokenizer, on a real Cassandra node: a message, an answer and a summary
keep the fingerprint of the tokenizer that counted them, and the summary's split of a chat that switched
to a model of another tokenizer (SmolLM2 → Gemma 3, which count Japanese text 46 and 16) counts anew
rather than reading the other tokenizer's counts."""

from __future__ import annotations

import dataclasses

import pytest

from chatmesh.finish import Usage
from chatmesh.model_files import gemma3_model_path
from chatmesh.tokenizer import ChatTokenizer, load_tokenizer
from memory_store.models import ChatSummary, Message, NewRun, RunDelta, RunOutcome, RunStatus
from memory_store.store import MemoryStore
from orchestrator.prompting.history import load_history
from orchestrator.upkeep.summaries import split_for_summary
from tests.memory_store.builders import message, new_user

JAPANESE = "東京都の天気は晴れです。" * 2  # SmolLM2: 46 tokens (bytes, mostly); Gemma 3: 16


@pytest.fixture(scope="module")
def smollm2() -> ChatTokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def gemma() -> ChatTokenizer:
    return load_tokenizer(str(gemma3_model_path()))


async def chat_answered_by(store: MemoryStore, tokenizer: ChatTokenizer) -> tuple[str, str, list[Message]]:
    """A chat of two exchanges answered by ``tokenizer``'s model, stored as sends store them: the
    questions counted with it, the answers by runs of it (their engine's count of output tokens).
    Returns the user, the chat and its messages as stored."""
    user = new_user()
    chat = await store.create_chat(user, "in Japanese")
    stored: list[Message] = []
    for question, answer in [("What is the weather in Tokyo?", JAPANESE), (JAPANESE, JAPANESE)]:
        claim = await store.claim_idempotency_key(user, f"key-{len(stored)}", b"fingerprint")
        parent = stored[-1] if stored else None
        counted = dataclasses.replace(
            message(chat.chat_id, question, parent, message_id=claim.user_message_id),
            token_count=len(tokenizer.encode(question)),
            tokenizer_fingerprint=tokenizer.fingerprint,
            run_id=claim.run_id,
        )
        run = await store.create_run_with_question(
            NewRun(
                user,
                chat.chat_id,
                run_id=claim.run_id,
                parent_message_id=counted.message_id,
                assistant_message_id=claim.assistant_message_id,
                model=tokenizer.model_name,
                owner_id="replica-a",
                user_message_id=counted.message_id,
                tokenizer_fingerprint=tokenizer.fingerprint,
            ),
            counted,
            await store.get_chat(user, chat.chat_id),
        )
        ids = tuple(tokenizer.encode(answer))
        outcome = RunOutcome(
            RunStatus.COMPLETED,
            1,
            tail=(RunDelta(1, answer, len(ids), ids),),
            usage=Usage(prompt_tokens=10, completion_tokens=len(ids)),
        )
        finished = await store.finish_run(run, outcome)
        assert finished.message is not None
        stored += [counted, finished.message]
    return user, chat.chat_id, stored


async def test_every_stored_count_keeps_the_fingerprint_of_its_tokenizer(
    memory_store: MemoryStore, smollm2: ChatTokenizer
) -> None:
    user, chat_id, _ = await chat_answered_by(memory_store, smollm2)
    history = await load_history(memory_store, user, chat_id, None, 100)
    assert [(m.token_count, m.tokenizer_fingerprint) for m in history.messages] == [
        (len(smollm2.encode(m.content)), smollm2.fingerprint) for m in history.messages
    ]
    through = history.messages[1].message_id
    summary = ChatSummary("Tokyo is sunny.", 5, through, tokenizer_fingerprint=smollm2.fingerprint)
    await memory_store.put_summary(user, chat_id, summary)
    read = (await load_history(memory_store, user, chat_id, None, 100)).summary
    assert read is not None and (read.token_count, read.tokenizer_fingerprint) == (5, smollm2.fingerprint)


async def test_after_a_switch_to_another_tokenizer_the_summary_split_counts_anew(
    memory_store: MemoryStore, smollm2: ChatTokenizer, gemma: ChatTokenizer
) -> None:
    user, chat_id, _ = await chat_answered_by(memory_store, smollm2)
    messages = (await load_history(memory_store, user, chat_id, None, 100)).messages
    gemma_counts = [len(gemma.encode(m.content)) for m in messages]
    smollm2_counts = [len(smollm2.encode(m.content)) for m in messages]
    assert gemma_counts[1:] == [16, 16, 16] and smollm2_counts[1:] == [46, 46, 46]
    # Kept verbatim: what is worth the whole chat in Gemma's tokens. Gemma's prompt holds it all, so
    # nothing needs summarizing; read as SmolLM2's counts, it would hold only the last answer.
    keep = sum(gemma_counts)
    older, newest = split_for_summary(messages, gemma, keep)
    assert (older, newest) == ([], messages)
    # Counted with the tokenizer that stored them, the stored counts are read as they are.
    older, newest = split_for_summary(messages, smollm2, keep)
    assert newest == messages[-1:]


async def test_a_count_of_the_same_tokenizer_is_read_as_stored_and_one_of_unknown_tokenizer_is_retaken(
    memory_store: MemoryStore, smollm2: ChatTokenizer
) -> None:
    """The engine's count of an answer's output tokens may differ from encoding its text again (a tool
    call's markup, a stop string): of the same tokenizer, it is what counts. A count stored before
    fingerprints were (none) is taken again."""
    user = new_user()
    chat = await memory_store.create_chat(user, "counts")
    counted = dataclasses.replace(
        message(chat.chat_id, JAPANESE), token_count=500, tokenizer_fingerprint=smollm2.fingerprint
    )
    unknown = dataclasses.replace(message(chat.chat_id, JAPANESE, counted), token_count=500)
    for stored in (counted, unknown):
        await memory_store.append_message(user, stored)
    messages = (await load_history(memory_store, user, chat.chat_id, None, 100)).messages
    assert [m.tokenizer_fingerprint for m in messages] == [smollm2.fingerprint, ""]
    # 46 (the unknown count, taken again) fits 100; 500 (the stored one, as stored) does not.
    assert split_for_summary(messages, smollm2, 100) == (messages[:1], messages[1:])
