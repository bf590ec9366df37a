"""OpenAI's Conversations API and a response's input items through the real mesh (Envoy -> edge ->
orchestrator -> router -> paced null engines, Cassandra), driven by the official ``openai`` SDK,
unmodified: a conversation is a stored chat and its items its messages, so a response created in it
reads them as history and adds its input and answer to them."""

from __future__ import annotations

import openai
import pytest

from tests.fixtures.front_door import MeshFrontDoor

HISTORY = [
    {"type": "message", "role": "user", "content": "Remember the number 42."},
    {"role": "assistant", "content": [{"type": "output_text", "text": "Noted: 42."}]},
]


@pytest.fixture
def sdk(mesh_front_door: MeshFrontDoor, user: str) -> openai.OpenAI:
    return mesh_front_door.sdk(user)


def texts(items) -> list[tuple[str, str]]:
    return [(item.role, item.content[0].text) for item in items]


def test_a_conversation_is_created_with_items_and_metadata_updated_and_deleted_and_only_its_owners(
    sdk: openai.OpenAI, mesh_front_door: MeshFrontDoor, user: str
):
    conversation = sdk.conversations.create(items=HISTORY, metadata={"topic": "numbers"})
    assert conversation.id.startswith("conv_") and conversation.object == "conversation"
    assert conversation.metadata == {"topic": "numbers"} and conversation.created_at > 0
    assert sdk.conversations.retrieve(conversation.id).metadata == {"topic": "numbers"}
    assert sdk.conversations.update(conversation.id, metadata={"topic": "42"}).metadata == {"topic": "42"}
    assert sdk.conversations.retrieve(conversation.id).metadata == {"topic": "42"}
    listed = sdk.conversations.items.list(conversation.id, order="asc")
    assert texts(listed.data) == [("user", "Remember the number 42."), ("assistant", "Noted: 42.")]
    assert [item.content[0].type for item in listed.data] == ["input_text", "output_text"]

    # Another user's conversation is not found, whatever they do with it.
    stranger = mesh_front_door.sdk(f"{user}-stranger")
    for call in (
        lambda: stranger.conversations.retrieve(conversation.id),
        lambda: stranger.conversations.update(conversation.id, metadata={}),
        lambda: stranger.conversations.items.list(conversation.id),
        lambda: stranger.conversations.items.create(conversation.id, items=HISTORY[:1]),
        lambda: stranger.conversations.delete(conversation.id),
        lambda: stranger.responses.create(input="42?", conversation=conversation.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert len(sdk.conversations.items.list(conversation.id).data) == 2

    deleted = sdk.conversations.delete(conversation.id)
    assert (deleted.id, deleted.deleted) == (conversation.id, True)
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve("conv_not-one-of-ours")


def test_items_are_added_then_listed_in_pages_in_either_order_and_retrieved_one_by_one(sdk: openai.OpenAI):
    conversation = sdk.conversations.create()
    words = ["one", "two", "three", "four", "five"]
    added = sdk.conversations.items.create(
        conversation.id, items=[{"role": "user", "content": word} for word in words]
    )
    assert texts(added.data) == [("user", word) for word in words]
    newest = sdk.conversations.items.list(conversation.id, limit=2)  # newest first by default
    assert texts(newest.data) == [("user", "five"), ("user", "four")] and newest.has_more
    after = sdk.conversations.items.list(conversation.id, limit=2, after=newest.data[-1].id)
    assert texts(after.data) == [("user", "three"), ("user", "two")]
    # The SDK's pager follows last_id to the end.
    assert [
        text for _, text in texts(sdk.conversations.items.list(conversation.id, order="asc", limit=2))
    ] == words
    third = sdk.conversations.items.retrieve(added.data[2].id, conversation_id=conversation.id)
    assert (third.id, third.content[0].text) == (added.data[2].id, "three")
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve("msg_0", conversation_id=conversation.id)


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (
            lambda sdk, c: sdk.conversations.items.create(
                c, items=[{"type": "function_call_output", "call_id": "x", "output": "1"}]
            ),
            "items[0].type",
        ),
        (
            lambda sdk, c: sdk.conversations.items.create(
                c, items=[{"role": "system", "content": "Be terse."}]
            ),
            "items[0].role",
        ),
        (lambda sdk, c: sdk.conversations.items.list(c, include=["message.output_text.logprobs"]), "include"),
        (lambda sdk, c: sdk.conversations.update(c, metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
        (lambda sdk, c: sdk.conversations.items.list(c, order="sideways"), "order"),  # type: ignore[arg-type]
        (lambda sdk, c: sdk.responses.create(input="Hi", conversation=c, store=False), "conversation"),
        (
            lambda sdk, c: sdk.responses.create(input="Hi", conversation=c, previous_response_id="resp_1"),
            "conversation",
        ),
    ],
)
def test_what_a_conversation_does_not_serve_is_refused_naming_the_parameter(sdk: openai.OpenAI, call, param):
    conversation = sdk.conversations.create(items=HISTORY)
    with pytest.raises(openai.BadRequestError) as refused:
        call(sdk, conversation.id)
    assert refused.value.param == param, refused.value.body
    assert len(sdk.conversations.items.list(conversation.id).data) == 2  # nothing was added


def test_a_response_in_a_conversation_reads_its_items_and_adds_its_input_and_answer(sdk: openai.OpenAI):
    conversation = sdk.conversations.create(items=HISTORY)
    response = sdk.responses.create(input="Which number?", conversation=conversation.id, max_output_tokens=8)
    items = list(sdk.conversations.items.list(conversation.id, order="asc"))
    assert texts(items)[:3] == [*texts_of(HISTORY), ("user", "Which number?")]
    assert texts(items)[3] == ("assistant", response.output_text) and items[3].id == response.output[0].id
    # The history was in the prompt: the same question alone is shorter.
    alone = sdk.responses.create(input="Which number?", max_output_tokens=8)
    assert response.usage.input_tokens > alone.usage.input_tokens

    inputs = sdk.responses.input_items.list(response.id)
    assert texts(inputs.data) == [("user", "Which number?")] and inputs.data[0].id == items[2].id

    # Several input items: the earlier ones are added first; as an object, the conversation is the same.
    more = [{"role": "user", "content": "Add one."}, {"role": "user", "content": "Now which?"}]
    sdk.responses.create(input=more, conversation={"id": conversation.id}, max_output_tokens=4)
    later = list(sdk.conversations.items.list(conversation.id, order="asc"))
    assert texts(later)[4:6] == [("user", "Add one."), ("user", "Now which?")] and len(later) == 7
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(
            input=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "?"}],
            conversation=conversation.id,
        )
    assert refused.value.param == "input"  # the Responses API names the top-level field


def texts_of(items: list[dict]) -> list[tuple[str, str]]:
    return [
        (item["role"], item["content"] if isinstance(item["content"], str) else item["content"][0]["text"])
        for item in items
    ]


def test_a_deleted_item_leaves_the_conversation_and_the_prompt_and_its_replies_follow_its_parent(
    sdk: openai.OpenAI,
):
    long_item = {"role": "user", "content": "Background: " + "lorem ipsum " * 100}
    conversation = sdk.conversations.create(items=[HISTORY[0], long_item, HISTORY[1]])
    first, kept, _ = list(sdk.conversations.items.list(conversation.id, order="asc"))
    before = sdk.responses.create(input="Which number?", conversation=conversation.id, max_output_tokens=4)

    after_delete = sdk.conversations.items.delete(kept.id, conversation_id=conversation.id)
    assert after_delete.id == conversation.id
    remaining = list(sdk.conversations.items.list(conversation.id, order="asc"))
    assert [item.id for item in remaining][:1] == [first.id] and kept.id not in [
        item.id for item in remaining
    ]
    assert texts(remaining)[1] == ("assistant", "Noted: 42.") and len(remaining) == 4
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve(kept.id, conversation_id=conversation.id)
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.delete(kept.id, conversation_id=conversation.id)
    # The next response's prompt no longer holds it (it holds the last exchange instead, far shorter).
    after = sdk.responses.create(input="Which number?", conversation=conversation.id, max_output_tokens=4)
    assert after.usage.input_tokens < before.usage.input_tokens - 100
    # A response whose input item was deleted has no input items left.
    question = list(sdk.conversations.items.list(conversation.id, order="asc"))[2]
    sdk.conversations.items.delete(question.id, conversation_id=conversation.id)
    assert sdk.responses.input_items.list(before.id).data == []
