"""A response refused before its answer began (the engine's queue limit, no engine left), through Envoy
and the edge, with the official ``openai`` SDK: a create, streamed or not, gets the HTTP error to retry
(429 or 503, Retry-After), as a refusal at the door does, and leaves no conversation behind, so the
SDK's own retries answer it once. A continuation carries its Idempotency-Key to the
orchestrator, whose retry answers the same question (tests/orchestrator/test_retries.py proves that part
on the real orchestrator; here the scripted chat service refuses the run)."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.front_door.conftest import ScriptedFrontDoor


def _live_chats(front_door: ScriptedFrontDoor, user: str) -> list[str]:
    return [chat.chat_id for owner, chat in list(front_door.scripted.chats.values()) if owner == user]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("code", "error", "status"),
    [
        ("RESOURCE_EXHAUSTED", openai.RateLimitError, 429),
        ("UNAVAILABLE", openai.InternalServerError, 503),
    ],
)
def test_a_new_conversation_refused_before_its_answer_is_an_error_to_retry_and_leaves_nothing(
    front_door: ScriptedFrontDoor,
    user: str,
    code: str,
    error: type[openai.APIStatusError],
    status: int,
    stream: bool,
) -> None:
    question = f"Busy? {uuid.uuid4().hex} !refusedonce {code} !tokens 3 10"
    with pytest.raises(error) as refused:
        front_door.sdk(user).responses.create(model="", input=question, stream=stream)
    assert refused.value.status_code == status
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.code == code.lower()
    assert _live_chats(front_door, user) == []  # the conversation it began is gone

    # The SDK's own retry (after Retry-After) is answered: one conversation, asked once.
    again = f"Busy? {uuid.uuid4().hex} !refusedonce {code} !tokens 3 10"
    answer = front_door.sdk(user, max_retries=2).responses.create(model="", input=again)
    assert answer.status == "completed" and answer.output_text
    chats = _live_chats(front_door, user)
    assert len(chats) == 1
    assert [m.content for m in front_door.scripted.messages[chats[0]] if m.content == again] == [again]


def test_a_refused_continuation_keeps_its_conversation_and_its_retry_carries_the_key(
    front_door: ScriptedFrontDoor, user: str
) -> None:
    sdk = front_door.sdk(user)
    first = sdk.responses.create(model="", input="Hello !tokens 3 10")
    key = f"key-{uuid.uuid4().hex}"
    follow_up = "And then? !refusedonce RESOURCE_EXHAUSTED !tokens 3 10"
    with pytest.raises(openai.RateLimitError):
        sdk.responses.create(
            model="", input=follow_up, previous_response_id=first.id, extra_headers={"Idempotency-Key": key}
        )
    assert len(_live_chats(front_door, user)) == 1  # the conversation it continues stays
    answer = sdk.responses.create(
        model="", input=follow_up, previous_response_id=first.id, extra_headers={"Idempotency-Key": key}
    )
    assert answer.status == "completed" and answer.output_text
    sends = [call.request for call in front_door.scripted.calls_to("SendMessage")][-2:]
    assert [send.idempotency_key for send in sends] == [key, key]  # type: ignore[attr-defined]


def test_a_refusal_after_text_is_a_failed_response_not_an_error_to_retry(
    front_door: ScriptedFrontDoor, user: str
) -> None:
    """Once the answer began, a retry would not be the same answer: the response is failed, and kept."""
    response = front_door.sdk(user).responses.create(
        model="", input="Go on !tokens 6 10 !runerror RESOURCE_EXHAUSTED 2"
    )
    assert response.status == "failed" and response.output_text
    assert response.error is not None and response.error.code == "rate_limit_exceeded"
    assert len(_live_chats(front_door, user)) == 1


def test_an_unstored_stream_refused_before_its_answer_is_an_error_to_retry(
    front_door: ScriptedFrontDoor, user: str
) -> None:
    with pytest.raises(openai.RateLimitError) as refused:
        front_door.sdk(user).responses.create(
            model="", input="Busy? !tokens 3 10 !runerror RESOURCE_EXHAUSTED 0", store=False, stream=True
        )
    assert refused.value.response.headers["retry-after"] == "2"
    assert _live_chats(front_door, user) == []


def test_a_background_response_answers_at_its_start(front_door: ScriptedFrontDoor, user: str) -> None:
    """A background create does not wait for the answer: it returns at the run's start, and the run's
    refusal right after is what retrieving it shows."""
    sdk = front_door.sdk(user)
    question = f"Busy? {uuid.uuid4().hex} !refusedonce RESOURCE_EXHAUSTED !tokens 3 10"
    response = sdk.responses.create(model="", input=question, background=True)
    assert response.status == "in_progress"
    ended = sdk.responses.retrieve(response.id)
    assert ended.status == "failed" and ended.error is not None
    assert ended.error.code == "rate_limit_exceeded"
