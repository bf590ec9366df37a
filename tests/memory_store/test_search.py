"""Chat search on a real Cassandra node (SAI over the words of titles and messages): only the caller's
chats, never a deleted one, newest first, every word of the query, and cursors that neither skip nor
repeat."""

import pytest
from cassandra.query import SimpleStatement

from memory_store.errors import InvalidArgument
from memory_store.models import Role
from memory_store.search import snippet
from memory_store.search_backfill import backfill_search
from memory_store.search_index import search_terms
from tests.memory_store.builders import message, new_user


async def everything(store, user: str, query: str, limit: int | None = None) -> list:
    """Every hit of a search, page after page."""
    hits, cursor = [], None
    while True:
        page = await store.search_chats(user, query, cursor, limit)
        hits.extend(page.items)
        if page.next_cursor is None:
            return hits
        cursor = page.next_cursor


async def test_titles_and_messages_match_every_word_newest_chat_first(memory_store):
    user = new_user()
    trip = await memory_store.create_chat(user, "Trip to Paris")
    question = await memory_store.append_message(
        user, message(trip.chat_id, "What is the capital of France?")
    )
    answer = await memory_store.append_message(
        user, message(trip.chat_id, "The capital of France is Paris.", question, Role.ASSISTANT)
    )
    cooking = await memory_store.create_chat(user, "Cooking")
    omelette = await memory_store.append_message(user, message(cooking.chat_id, "A PARIS-style omelette?"))

    hits = await everything(memory_store, user, "paris")
    assert [(h.chat_id, h.message_id, h.role) for h in hits] == [
        (cooking.chat_id, omelette.message_id, "user"),
        (trip.chat_id, answer.message_id, "assistant"),
        (trip.chat_id, None, "title"),
    ]
    assert hits[0].chat_title == "Cooking" and hits[0].snippet == "A PARIS-style omelette?"
    # Every word must match (in any case and order).
    hits = await everything(memory_store, user, "France CAPITAL paris")
    assert [h.message_id for h in hits] == [answer.message_id]
    assert await everything(memory_store, user, "paris berlin") == []
    # A rename is searchable at once, and the old title no longer is.
    await memory_store.rename_chat(user, cooking.chat_id, "Breakfast ideas")
    assert [h.chat_id for h in await everything(memory_store, user, "breakfast")] == [cooking.chat_id]
    assert await everything(memory_store, user, "cooking") == []


async def test_only_the_callers_chats_are_searched(memory_store):
    owner, other = new_user(), new_user()
    chat = await memory_store.create_chat(owner, "secret plans")
    await memory_store.append_message(owner, message(chat.chat_id, "the secret is in the garden"))
    assert len(await everything(memory_store, owner, "secret")) == 2
    assert await everything(memory_store, other, "secret") == []
    # A cursor of the owner's search is refused to anyone else, and for another query.
    page = await memory_store.search_chats(owner, "secret", limit=1)
    assert page.next_cursor is not None
    with pytest.raises(InvalidArgument):
        await memory_store.search_chats(other, "secret", page.next_cursor)
    with pytest.raises(InvalidArgument):
        await memory_store.search_chats(owner, "garden", page.next_cursor)


async def test_deleted_chats_never_appear(memory_store):
    user = new_user()
    kept = await memory_store.create_chat(user, "kept")
    gone = await memory_store.create_chat(user, "gone")
    await memory_store.append_message(user, message(kept.chat_id, "zebra one"))
    for i in range(5):
        await memory_store.append_message(user, message(gone.chat_id, f"zebra {i}"))
    await memory_store.delete_chat(user, gone.chat_id)
    hits = await everything(memory_store, user, "zebra", limit=1)
    assert [h.chat_id for h in hits] == [kept.chat_id]


async def test_pages_follow_each_other_without_gaps_or_repeats(memory_store):
    user = new_user()
    ids = []
    for c in range(3):
        chat = await memory_store.create_chat(user, f"chat {c}")
        for m in range(4):
            ids.append(
                (await memory_store.append_message(user, message(chat.chat_id, f"needle {c} {m}"))).message_id
            )
    for limit in (1, 3, 5, 50):
        hits = await everything(memory_store, user, "needle", limit)
        assert [h.message_id for h in hits] == list(reversed(ids)), limit


async def test_a_search_needs_words_and_not_too_many(memory_store):
    user = new_user()
    for query in ("", "  ?! ", "one two three four five six"):
        with pytest.raises(InvalidArgument):
            await memory_store.search_chats(user, query)


def test_words_are_normalized_case_folded_and_distinct():
    fullwidth_paris = "\uff30\uff41\uff52\uff49\uff53"  # NFKC makes it "Paris"
    assert search_terms(f"{fullwidth_paris}, PARIS and paris-style Straße") == [
        "paris",
        "and",
        "style",
        "strasse",
    ]
    long = "word " * 10 + "x" * 200
    assert "x" * 200 not in search_terms(long)
    text = "a" * 300 + " needle " + "b" * 300
    assert "needle" in snippet(text, ["needle"]) and len(snippet(text, ["needle"])) <= 162


async def test_the_backfill_indexes_chats_written_before_search_existed(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "Old walrus notes")
    old = await memory_store.append_message(user, message(chat.chat_id, "tusks and whiskers"))
    deleted = await memory_store.create_chat(user, "Old walrus drafts")
    await memory_store.append_message(user, message(deleted.chat_id, "tusks too"))
    await memory_store.delete_chat(user, deleted.chat_id)
    # As a keyspace from before migration 3 would be: none of it in the search table.
    await memory_store._db.execute(
        SimpleStatement("DELETE FROM chat_search WHERE user_id = %s"), (user,), operation="test"
    )
    assert await everything(memory_store, user, "tusks") == []

    chats, messages = await backfill_search(memory_store)
    assert chats >= 1 and messages >= 1
    assert [h.message_id for h in await everything(memory_store, user, "tusks")] == [old.message_id]
    assert [h.chat_id for h in await everything(memory_store, user, "walrus")] == [chat.chat_id]
    # Running it again changes nothing.
    await backfill_search(memory_store)
    assert [h.message_id for h in await everything(memory_store, user, "tusks")] == [old.message_id]
