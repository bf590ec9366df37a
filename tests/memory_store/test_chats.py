"""Chats on a real Cassandra node: ownership, activity order, paging, rename, soft delete, summaries."""

import asyncio

import pytest

from chatmesh.finish import FinishReason
from memory_store.errors import AlreadyExists, InvalidArgument, NotFound
from memory_store.ids import id_time, new_id
from memory_store.models import ChatSummary, NewRun, RunOutcome, RunStatus
from tests.memory_store.builders import message, new_user, operations_counted, requests_sent, start_run


async def test_another_users_chat_is_not_found_for_every_operation(memory_store):
    owner, intruder = new_user(), new_user()
    chat = await memory_store.create_chat(owner, "private")
    first = await memory_store.append_message(owner, message(chat.chat_id, "secret"))

    assert (await memory_store.get_chat(owner, chat.chat_id)).title == "private"
    attempts = [
        memory_store.get_chat(intruder, chat.chat_id),
        memory_store.rename_chat(intruder, chat.chat_id, "mine now"),
        memory_store.delete_chat(intruder, chat.chat_id),
        memory_store.list_messages(intruder, chat.chat_id),
        memory_store.get_message(intruder, chat.chat_id, first.message_id),
        memory_store.get_branch(intruder, chat.chat_id, None),
        memory_store.get_branch(intruder, chat.chat_id, first.message_id),
        memory_store.get_branch(intruder, chat.chat_id, None, with_summary=True),
        memory_store.append_message(intruder, message(chat.chat_id, "hi", first)),
    ]
    for attempt in attempts:
        with pytest.raises(NotFound):
            await attempt
    assert (await memory_store.list_chats(intruder)).items == []
    # Nothing the intruder tried changed the owner's chat.
    assert (await memory_store.get_chat(owner, chat.chat_id)).title == "private"
    assert [m.content for m in (await memory_store.list_messages(owner, chat.chat_id)).items] == ["secret"]


async def test_chats_are_listed_by_most_recent_activity(memory_store):
    user = new_user()
    first = await memory_store.create_chat(user, "first")
    second = await memory_store.create_chat(user, "second")
    third = await memory_store.create_chat(user, "third")
    assert [c.title for c in (await memory_store.list_chats(user)).items] == ["third", "second", "first"]

    await memory_store.append_message(user, message(first.chat_id, "back to the first"))
    assert [c.title for c in (await memory_store.list_chats(user)).items] == ["first", "third", "second"]

    renamed = await memory_store.rename_chat(user, second.chat_id, "second, renamed")
    listed = (await memory_store.list_chats(user)).items
    assert [c.title for c in listed] == ["second, renamed", "first", "third"]
    assert listed[0].updated_at == renamed.updated_at > renamed.created_at
    assert third.chat_id == listed[2].chat_id


async def test_concurrent_activity_leaves_each_chat_listed_once(memory_store):
    user = new_user()
    chats = [await memory_store.create_chat(user, f"chat {i}") for i in range(3)]
    await asyncio.gather(
        *(
            memory_store.rename_chat(user, chat.chat_id, f"chat {i}")
            for i, chat in enumerate(chats)
            for _ in range(10)
        ),
        *(memory_store.append_message(user, message(chats[0].chat_id, f"m{i}")) for i in range(10)),
    )
    listed = (await memory_store.list_chats(user)).items
    assert sorted(c.chat_id for c in listed) == sorted(c.chat_id for c in chats)
    stored = {c.chat_id: await memory_store.get_chat(user, c.chat_id) for c in chats}
    assert [c.updated_at for c in listed] == sorted((s.updated_at for s in stored.values()), reverse=True)


async def test_chat_pages_cover_every_chat_once(memory_store):
    user = new_user()
    created = [await memory_store.create_chat(user, f"chat {i}") for i in range(7)]
    seen, cursor, pages = [], None, 0
    while True:
        page = await memory_store.list_chats(user, cursor, limit=3)
        seen += [c.chat_id for c in page.items]
        pages += 1
        cursor = page.next_cursor
        if cursor is None:
            break
    assert pages == 3
    assert seen == [c.chat_id for c in reversed(created)]


async def test_deleted_chat_vanishes_from_lists_and_reads(memory_store):
    user = new_user()
    keep = await memory_store.create_chat(user, "keep")
    doomed = await memory_store.create_chat(user, "doomed")
    hello = await memory_store.append_message(user, message(doomed.chat_id, "hello"))

    await memory_store.delete_chat(user, doomed.chat_id)

    assert [c.chat_id for c in (await memory_store.list_chats(user)).items] == [keep.chat_id]
    for read in (
        memory_store.get_chat(user, doomed.chat_id),
        memory_store.list_messages(user, doomed.chat_id),
        memory_store.get_message(user, doomed.chat_id, hello.message_id),
        memory_store.append_message(user, message(doomed.chat_id, "anyone?", hello)),
        memory_store.delete_chat(user, doomed.chat_id),
    ):
        with pytest.raises(NotFound):
            await read


async def test_titles_are_bounded(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "t" * 200)
    with pytest.raises(InvalidArgument, match="title"):
        await memory_store.create_chat(user, "t" * 201)
    with pytest.raises(InvalidArgument, match="title"):
        await memory_store.rename_chat(user, chat.chat_id, "")
    with pytest.raises(InvalidArgument, match="title"):
        await memory_store.rename_chat(user, chat.chat_id, "x" * 201)
    assert (await memory_store.rename_chat(user, chat.chat_id, "ünïcødé 标题 🚀")).title == "ünïcødé 标题 🚀"
    assert (await memory_store.get_chat(user, chat.chat_id)).title == "ünïcødé 标题 🚀"


async def test_page_sizes_are_bounded(memory_store):
    user = new_user()
    with pytest.raises(InvalidArgument, match="page size"):
        await memory_store.list_chats(user, limit=101)
    with pytest.raises(InvalidArgument, match="page size"):
        await memory_store.list_chats(user, limit=-1)
    assert (await memory_store.list_chats(user, limit=0)).items == []


async def test_tampered_or_foreign_chat_cursor_is_invalid_argument(memory_store):
    user, other = new_user(), new_user()
    for i in range(3):
        await memory_store.create_chat(user, f"chat {i}")
    cursor = (await memory_store.list_chats(user, limit=1)).next_cursor
    assert cursor
    flipped = cursor[:-3] + ("A" if cursor[-3] != "A" else "B") + cursor[-2:]
    for bad in (flipped, cursor[:-1], "not-a-cursor", "A" * 600):
        with pytest.raises(InvalidArgument, match="page token"):
            await memory_store.list_chats(user, bad)
    # A valid cursor of one user is refused for another.
    with pytest.raises(InvalidArgument, match="page token"):
        await memory_store.list_chats(other, cursor)


async def test_malformed_ids_are_invalid_argument(memory_store):
    user = new_user()
    for bad in ("", "nope", "00000000-0000-4000-8000-000000000000"):
        with pytest.raises(InvalidArgument):
            await memory_store.get_chat(user, bad)


async def test_active_run_follows_the_newest_run(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "runs")
    older, asked = await start_run(memory_store, user, chat.chat_id, "q1")
    newer, _ = await start_run(memory_store, user, chat.chat_id, "q2", asked)
    # A late retry of the older run's creation: the newer run stays the chat's active one.
    again = NewRun(
        user,
        chat.chat_id,
        run_id=older.run_id,
        parent_message_id=older.parent_message_id,
        assistant_message_id=older.assistant_message_id,
        model=older.model,
        owner_id=older.owner_id,
        user_message_id=older.user_message_id,
    )
    await memory_store.create_run(again)
    assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id == newer.run_id

    cancelled = RunOutcome(RunStatus.CANCELLED, 1, FinishReason.CANCELLED)
    await memory_store.finish_run(older, cancelled)
    assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id == newer.run_id
    await memory_store.finish_run(newer, cancelled)
    assert (await memory_store.get_chat(user, chat.chat_id)).active_run_id is None


async def test_summary_is_replaced_and_read_back(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "long chat")
    assert (await memory_store.get_branch(user, chat.chat_id, None, with_summary=True)).summary is None
    first = await memory_store.append_message(user, message(chat.chat_id, "turn 1"))
    second = await memory_store.append_message(user, message(chat.chat_id, "turn 2", first))

    await memory_store.put_summary(user, chat.chat_id, ChatSummary("They said hi.", 4, first.message_id))
    await memory_store.put_summary(
        user, chat.chat_id, ChatSummary("They said hi twice. ✓", 6, second.message_id)
    )

    # Read with the branch, under one ownership check.
    before = operations_counted()
    branch = await memory_store.get_branch(user, chat.chat_id, None, with_summary=True)
    assert requests_sent(before)["chat_get"] == 1
    summary = branch.summary
    assert (summary.text, summary.token_count, summary.through_message_id) == (
        "They said hi twice. ✓",
        6,
        second.message_id,
    )
    assert [m.message_id for m in branch.messages] == [first.message_id, second.message_id]
    assert (await memory_store.get_branch(user, chat.chat_id, None)).summary is None
    with pytest.raises(InvalidArgument, match="summary"):
        await memory_store.put_summary(
            user, chat.chat_id, ChatSummary("x" * (64 * 1024 + 1), 1, first.message_id)
        )


async def test_racing_creates_with_one_key_make_one_chat(memory_store):
    user = new_user()
    chats = await asyncio.gather(*(memory_store.create_chat(user, "Paris?", "key-1") for _ in range(8)))
    assert len({chat.chat_id for chat in chats}) == 1
    assert [chat.chat_id for chat in (await memory_store.list_chats(user)).items] == [chats[0].chat_id]
    # The key is the user's own: another user's key of the same name makes their own chat.
    other = await memory_store.create_chat(new_user(), "Paris?", "key-1")
    assert other.chat_id != chats[0].chat_id
    # Without a key every create is a chat.
    assert (await memory_store.create_chat(user, "Paris?")).chat_id != chats[0].chat_id


async def test_a_keyed_create_returns_the_chat_as_it_is_now_and_refuses_another_title(memory_store):
    user = new_user()
    first = await memory_store.create_chat(user, "Paris?", "key-1")
    await memory_store.rename_chat(user, first.chat_id, "Trip to Paris")
    again = await memory_store.create_chat(user, "Paris?", "key-1")
    assert (again.chat_id, again.title) == (first.chat_id, "Trip to Paris")
    with pytest.raises(AlreadyExists):
        await memory_store.create_chat(user, "Rome?", "key-1")
    await memory_store.delete_chat(user, first.chat_id)
    with pytest.raises(NotFound):  # deleted stays deleted: the key does not bring it back
        await memory_store.create_chat(user, "Paris?", "key-1")
    assert (await memory_store.list_chats(user)).items == []


async def test_a_key_claimed_by_a_create_that_died_before_writing_its_chat_gets_that_chat(memory_store):
    """The key is claimed, then the chat written: a create lost between the two leaves the key naming a
    chat that does not exist. Its retry writes that chat, with the id and creation time the key names."""
    user = new_user()
    lost = new_id()
    await memory_store._db.execute("chat_key_claim", (user, "key-1", lost, "Paris?", 3600))
    chat = await memory_store.create_chat(user, "Paris?", "key-1")
    assert chat.chat_id == str(lost)
    assert abs((chat.created_at - id_time(lost)).total_seconds()) < 0.001
    assert (await memory_store.get_chat(user, str(lost))).title == "Paris?"
    assert [c.chat_id for c in (await memory_store.list_chats(user)).items] == [str(lost)]


async def test_a_create_key_is_checked(memory_store):
    with pytest.raises(InvalidArgument):
        await memory_store.create_chat(new_user(), "", "k" * 129)


async def test_a_chats_metadata_is_stored_replaced_whole_and_bounded(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "", metadata={"topic": "numbers", "lang": "en"})
    assert (await memory_store.get_chat(user, chat.chat_id)).metadata == {"topic": "numbers", "lang": "en"}
    replaced = await memory_store.set_chat_metadata(user, chat.chat_id, {"topic": "42"})
    assert replaced.metadata == {"topic": "42"} == (await memory_store.get_chat(user, chat.chat_id)).metadata
    assert (await memory_store.list_chats(user)).items[0].metadata == {"topic": "42"}
    for bad in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"": "v"}):
        with pytest.raises(InvalidArgument, match="metadata"):
            await memory_store.set_chat_metadata(user, chat.chat_id, bad)
    with pytest.raises(NotFound):
        await memory_store.set_chat_metadata(new_user(), chat.chat_id, {})
