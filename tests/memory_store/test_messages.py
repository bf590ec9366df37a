"""Messages on a real Cassandra node: paging across buckets, round trips, trees, limits, no null writes."""

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from chatmesh.finish import FinishReason, Usage
from memory_store.errors import FailedPrecondition, InvalidArgument, NotFound
from memory_store.ids import new_id
from memory_store.messages import bucket_of
from memory_store.models import ChatSummary, Message, MessageStatus, Role
from tests.memory_store.builders import message, new_user, operations_counted, regenerated_tree, requests_sent


async def read_all_pages(store, user, chat_id, page_size):
    ids, cursor = [], None
    while True:
        page = await store.list_messages(user, chat_id, before=cursor, limit=page_size)
        ids += [m.message_id for m in page.items]
        cursor = page.next_cursor
        if cursor is None:
            return ids
        await asyncio.sleep(0)  # let concurrent appends interleave with the paging


async def test_pages_cross_buckets_without_gaps_or_repeats_during_concurrent_appends(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "spanning days")
    today = datetime.now(UTC) - timedelta(minutes=5)
    # Five days, two of them empty, 9 messages on each of the other three.
    days = [today - timedelta(days=4), today - timedelta(days=2), today]
    existing = [
        message(chat.chat_id, f"day {d} #{i}", at=day + timedelta(seconds=i))
        for d, day in enumerate(days)
        for i in range(9)
    ]
    await asyncio.gather(*(memory_store.append_message(user, m) for m in existing))
    assert len({bucket_of(uuid.UUID(m.message_id)) for m in existing}) == 3

    appended: list[Message] = []

    async def keep_appending():
        for i in range(20):
            appended.append(await memory_store.append_message(user, message(chat.chat_id, f"live {i}")))

    listed, _ = await asyncio.gather(read_all_pages(memory_store, user, chat.chat_id, 4), keep_appending())

    assert len(listed) == len(set(listed)), "a message was listed twice"
    assert set(m.message_id for m in existing) <= set(listed), "an existing message was skipped"
    assert set(listed) <= {m.message_id for m in existing + appended}
    assert [uuid.UUID(i).time for i in listed] == sorted((uuid.UUID(i).time for i in listed), reverse=True)
    # Once appends stop, one pass sees everything, newest first.
    everything = await read_all_pages(memory_store, user, chat.chat_id, 7)
    expected = sorted(existing + appended, key=lambda m: uuid.UUID(m.message_id).time, reverse=True)
    assert everything == [m.message_id for m in expected]


async def test_the_newest_branch_is_read_from_the_chats_newest_message_in_any_bucket(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "newest branch")
    empty = await memory_store.get_branch(user, chat.chat_id, None)
    assert empty.messages == [] and not empty.truncated and empty.chat.chat_id == chat.chat_id
    # Newest three days ago: the scan's guess (today's bucket) misses, and the bucket list finds it.
    at = datetime.now(UTC) - timedelta(days=3)
    root = await memory_store.append_message(user, message(chat.chat_id, "q1", at=at))
    answer = await memory_store.append_message(
        user, message(chat.chat_id, "a1", root, at=at + timedelta(minutes=1))
    )
    await memory_store.append_message(user, message(chat.chat_id, "edit", at=at - timedelta(minutes=5)))
    old = await memory_store.get_branch(user, chat.chat_id, None)
    assert [m.content for m in old.messages] == ["q1", "a1"]
    # Today: the guess is right, and the branch goes on into the older bucket.
    today = await memory_store.append_message(user, message(chat.chat_id, "q2", answer))
    new = await memory_store.get_branch(user, chat.chat_id, None, max_messages=2)
    assert [m.content for m in new.messages] == ["a1", "q2"] and new.truncated
    assert new.messages[-1].message_id == today.message_id
    with pytest.raises(NotFound):
        await memory_store.get_branch(new_user(), chat.chat_id, None)


async def test_unicode_and_large_content_round_trip_exactly(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "round trip")
    samples = [
        "emoji 👩‍👩‍👧‍👦🚀, CJK 漢字かなカナ, RTL עברית العربية, combining é (e\u0301), zero width \u200d\u200b",
        "a NUL \x00 in the middle, tabs\tand\nnewlines\r\n",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 beyond the BMP: 𐍈 🀄 \U0010fffd",  # noqa: RUF001 - look-alike letters on purpose
        "x" * (32 * 1024),  # exactly the user limit
    ]
    stored = []
    parent = None
    for text in samples:
        parent = await memory_store.append_message(user, message(chat.chat_id, text, parent))
        stored.append(parent)
    big = "é" * (128 * 1024)  # 256 KiB of UTF-8: the assistant limit
    answer = Message(
        message_id=str(new_id()),
        chat_id=chat.chat_id,
        role=Role.ASSISTANT,
        content=big,
        parent_id=parent.message_id,
        token_count=70_000,
        model="smollm2-135m",
        finish_reason=FinishReason.LENGTH,
        status=MessageStatus.INCOMPLETE,
        usage=Usage(prompt_tokens=100, cached_prompt_tokens=64, completion_tokens=70_000),
    )
    await memory_store.append_message(user, answer)

    for original in [*stored, answer]:
        assert await memory_store.get_message(user, chat.chat_id, original.message_id) == original
    with pytest.raises(InvalidArgument, match="32768 bytes"):
        await memory_store.append_message(user, message(chat.chat_id, "x" * (32 * 1024 + 1)))
    with pytest.raises(InvalidArgument, match="262144 bytes"):
        await memory_store.append_message(
            user, message(chat.chat_id, "é" * (128 * 1024) + "!", role=Role.ASSISTANT)
        )


async def test_branch_walks_parent_links_through_edits_and_regenerations(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "tree")
    add = lambda text, parent=None, role=Role.USER: memory_store.append_message(  # noqa: E731
        user, message(chat.chat_id, text, parent, role)
    )
    tree = await regenerated_tree(memory_store, user, chat.chat_id)
    a1, a1_again, a2 = tree["a1"], tree["a1 regenerated"], tree["a2"]
    q2_edited = await add("q2 edited", a1_again)  # sibling of q2
    a2_edited = await add("a2 for the edit", q2_edited, Role.ASSISTANT)
    await add("q3 on the first branch", a1)

    branch = await memory_store.get_branch(user, chat.chat_id, a2_edited.message_id)
    assert [m.content for m in branch.messages] == ["q1", "a1 regenerated", "q2 edited", "a2 for the edit"]
    assert not branch.truncated
    other = await memory_store.get_branch(user, chat.chat_id, a2.message_id)
    assert [m.content for m in other.messages] == ["q1", "a1 regenerated", "q2", "a2"]

    newest_two = await memory_store.get_branch(user, chat.chat_id, a2.message_id, max_messages=2)
    assert [m.content for m in newest_two.messages] == ["q2", "a2"]
    assert newest_two.truncated

    # A message that is not in this chat has no branch here.
    other_chat = await memory_store.create_chat(user, "other")
    for missing in (str(new_id()), a2.message_id):
        with pytest.raises(NotFound):
            await memory_store.get_branch(
                user, other_chat.chat_id if missing == a2.message_id else chat.chat_id, missing
            )


async def test_branch_spans_buckets(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "slow chat")
    start = datetime.now(UTC) - timedelta(days=6)
    parent = None
    chain = []
    for day in range(6):
        for i in range(3):
            at = start + timedelta(days=day, minutes=i)
            parent = await memory_store.append_message(
                user, message(chat.chat_id, f"d{day}m{i}", parent, at=at)
            )
            chain.append(parent.content)
        # Noise on another branch of the same day.
        await memory_store.append_message(
            user, message(chat.chat_id, "noise", at=start + timedelta(days=day, minutes=9))
        )
    branch = await memory_store.get_branch(user, chat.chat_id, parent.message_id)
    assert [m.content for m in branch.messages] == chain


async def test_retried_append_stores_one_row(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "retries")
    once = message(chat.chat_id, "sent once, retried five times")
    await asyncio.gather(*(memory_store.append_message(user, once) for _ in range(6)))
    assert [m.message_id for m in (await memory_store.list_messages(user, chat.chat_id)).items] == [
        once.message_id
    ]


async def test_parent_must_be_in_the_chat_and_older(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "parents")
    other_chat = await memory_store.create_chat(user, "elsewhere")
    elsewhere = await memory_store.append_message(user, message(other_chat.chat_id, "elsewhere"))
    with pytest.raises(FailedPrecondition, match="not in chat"):
        await memory_store.append_message(user, message(chat.chat_id, "orphan", elsewhere))
    later = message(chat.chat_id, "made later")
    earlier = Message(
        str(new_id(datetime.now(UTC) - timedelta(seconds=5))), chat.chat_id, Role.USER, "x", later.message_id
    )
    await memory_store.append_message(user, later)
    with pytest.raises(FailedPrecondition, match="older"):
        await memory_store.append_message(user, earlier)
    with pytest.raises(InvalidArgument, match="future"):
        await memory_store.append_message(
            user, message(chat.chat_id, "from the future", at=datetime.now(UTC) + timedelta(hours=1))
        )
    with pytest.raises(NotFound):
        await memory_store.get_message(user, chat.chat_id, str(new_id()))


async def test_message_cursor_is_bound_to_its_chat(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "a")
    other = await memory_store.create_chat(user, "b")
    for i in range(3):
        await memory_store.append_message(user, message(chat.chat_id, f"m{i}"))
    cursor = (await memory_store.list_messages(user, chat.chat_id, limit=1)).next_cursor
    with pytest.raises(InvalidArgument, match="page token"):
        await memory_store.list_messages(user, other.chat_id, before=cursor)
    with pytest.raises(InvalidArgument, match="page token"):
        await memory_store.list_messages(
            user, chat.chat_id, before=cursor.replace(cursor[5], "_" if cursor[5] != "_" else "-")
        )
    with pytest.raises(InvalidArgument, match="page size"):
        await memory_store.list_messages(user, chat.chat_id, limit=201)


async def test_messages_without_optional_fields_write_no_tombstones(memory_store):
    """Absent fields are left unset, not written as nulls: a read of the partition meets no tombstone."""
    user = new_user()
    chat = await memory_store.create_chat(user, "tombstones")
    root = await memory_store.append_message(user, message(chat.chat_id, "root: no parent, model or usage"))
    key = uuid.UUID(root.message_id)
    session = memory_store._db.session
    result = await asyncio.to_thread(
        session.execute,
        "SELECT * FROM chatmesh_test.messages WHERE chat_id = %s AND bucket = %s",
        (uuid.UUID(chat.chat_id), bucket_of(key)),
        trace=True,
    )
    events = [e.description for e in result.get_query_trace(max_wait_sec=10).events]
    read = [e for e in events if "live rows and" in e]
    assert read, events
    assert all(e.endswith("and 0 tombstone cells") for e in read), read


async def read_branch(store, user, chat_id, leaf_id, page_size):
    """Every page of a branch, leaf first: the ids of each page."""
    pages, cursor = [], None
    while True:
        page = await store.branch_page(user, chat_id, leaf_id, cursor, page_size)
        pages.append([m.message_id for m in page.items])
        cursor = page.next_cursor
        if cursor is None:
            return pages


async def test_a_branch_pages_from_its_leaf_to_the_root_reading_only_what_each_page_needs(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "branches over days")
    start = datetime.now(UTC) - timedelta(days=4)
    # A 12-message path over three days (4 a day); off its 5th message grows a 30-message branch, newer
    # than the path's 6th and older than its 7th; the newest message of all is on that branch.
    path: list[Message] = []
    others: list[Message] = []
    at = start
    for i in range(12):
        at += timedelta(hours=25) if i % 4 == 0 else timedelta(seconds=1)
        path.append(
            await memory_store.append_message(
                user, message(chat.chat_id, f"p{i}", path[-1] if path else None, at=at)
            )
        )
        if i == 5:
            for j in range(30):
                parent = others[-1] if others else path[4]
                others.append(
                    await memory_store.append_message(
                        user, message(chat.chat_id, f"o{j}", parent, at=at + timedelta(milliseconds=10 + j))
                    )
                )
    newest = await memory_store.append_message(user, message(chat.chat_id, "o-newest", others[-1]))
    assert len({bucket_of(uuid.UUID(m.message_id)) for m in path}) == 3

    leaf_first = [m.message_id for m in reversed(path)]
    pages = await read_branch(memory_store, user, chat.chat_id, path[-1].message_id, 5)
    assert pages == [leaf_first[0:5], leaf_first[5:10], leaf_first[10:12]]
    # Pages of a day's 4: the leaf's page is one query of 4 rows. The next one reads p7, p6 and 2 rows
    # of the other branch, then starts again at p5 (p5, p4). A page over a day boundary costs one
    # query more (p11..p8, then p7 in the day before).
    # A page's versions take one query more (children_of).
    before = operations_counted()
    first = await memory_store.branch_page(user, chat.chat_id, path[-1].message_id, None, 4)
    assert requests_sent(before) == {"chat_get": 1, "messages_upto": 1, "children_of": 1}
    before = operations_counted()
    second = await memory_store.branch_page(user, chat.chat_id, path[-1].message_id, first.next_cursor, 4)
    assert requests_sent(before) == {"chat_get": 1, "messages_upto": 2, "children_of": 1}
    assert [m.content for m in second.items] == ["p7", "p6", "p5", "p4"]
    # p5 and o0 are the two versions of p4's reply, p5 the older.
    assert [(v.count, v.number) for v in second.versions] == [(1, 1), (1, 1), (2, 1), (1, 1)]
    assert second.versions[2].next_id == others[0].message_id and second.versions[2].previous_id is None
    before = operations_counted()
    await memory_store.branch_page(user, chat.chat_id, path[-1].message_id, None, 5)
    assert requests_sent(before) == {"chat_get": 1, "messages_upto": 2, "children_of": 1}

    # No leaf: the chat's newest message is the leaf.
    newest_first = [m.message_id for m in [newest, *reversed(others), *reversed(path[:5])]]
    pages = await read_branch(memory_store, user, chat.chat_id, None, 8)
    assert [i for page in pages for i in page] == newest_first


async def test_a_branch_page_places_each_message_among_its_versions_and_opens_a_versions_newest_leaf(
    memory_store,
):
    user = new_user()
    chat = await memory_store.create_chat(user, "versions")
    tree = await regenerated_tree(memory_store, user, chat.chat_id)
    first_root = tree["q1"]
    # q1 edited (a second first message) with an answer; a1 (the older answer) answered further on.
    edited = await memory_store.append_message(user, message(chat.chat_id, "q1 edited"))
    await memory_store.append_message(user, message(chat.chat_id, "a edited", edited, Role.ASSISTANT))
    q3 = await memory_store.append_message(user, message(chat.chat_id, "q3", tree["a1"]))
    a3 = await memory_store.append_message(user, message(chat.chat_id, "a3", q3, Role.ASSISTANT))

    page = await memory_store.branch_page(user, chat.chat_id, tree["a2"].message_id, None, 10)
    assert [m.content for m in page.items] == ["a2", "q2", "a1 regenerated", "q1"]
    assert [(v.count, v.number) for v in page.versions] == [(1, 1), (1, 1), (2, 2), (2, 1)]
    regenerated, root = page.versions[2], page.versions[3]
    assert (regenerated.previous_id, regenerated.next_id) == (tree["a1"].message_id, None)
    assert (root.previous_id, root.next_id) == (None, edited.message_id)

    # Switching to a1, the older version: its branch from the newest message under it (a3).
    page = await memory_store.branch_page(
        user, chat.chat_id, regenerated.previous_id, None, 10, newest_under=True
    )
    assert [m.content for m in page.items] == ["a3", "q3", "a1", "q1"]
    assert page.items[0].message_id == a3.message_id
    assert [(v.count, v.number) for v in page.versions][2:] == [(2, 1), (2, 1)]
    # A leaf is its own newest message; the branch's older pages follow its cursor.
    page = await memory_store.branch_page(user, chat.chat_id, a3.message_id, None, 2, newest_under=True)
    rest = await memory_store.branch_page(
        user, chat.chat_id, a3.message_id, page.next_cursor, 2, newest_under=True
    )
    assert [m.content for m in page.items + rest.items] == ["a3", "q3", "a1", "q1"]
    assert rest.items[-1].message_id == first_root.message_id
    with pytest.raises(InvalidArgument):
        await memory_store.branch_page(user, chat.chat_id, None, None, 2, newest_under=True)


async def test_a_branch_refuses_an_unknown_leaf_another_users_chat_and_a_foreign_cursor(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "refusals")
    empty = await memory_store.branch_page(user, chat.chat_id, None, None, 5)
    assert empty.items == [] and empty.next_cursor is None
    tree = await regenerated_tree(memory_store, user, chat.chat_id)
    with pytest.raises(NotFound):
        await memory_store.branch_page(user, chat.chat_id, str(new_id()), None, 5)
    with pytest.raises(NotFound):
        await memory_store.branch_page(new_user(), chat.chat_id, tree["a2"].message_id, None, 5)
    other = await memory_store.create_chat(user, "another")
    with pytest.raises(NotFound):
        await memory_store.branch_page(user, other.chat_id, tree["a2"].message_id, None, 5)
    page = await memory_store.branch_page(user, chat.chat_id, tree["a2"].message_id, None, 2)
    assert [m.content for m in page.items] == ["a2", "q2"]
    # A cursor belongs to its chat and leaf.
    with pytest.raises(InvalidArgument):
        await memory_store.branch_page(user, chat.chat_id, tree["a1"].message_id, page.next_cursor, 2)
    rest = await memory_store.branch_page(user, chat.chat_id, tree["a2"].message_id, page.next_cursor, 2)
    assert [m.content for m in rest.items] == ["a1 regenerated", "q1"] and rest.next_cursor is None
    assert [
        m.content
        for m in (await memory_store.branch_page(user, chat.chat_id, tree["a1"].message_id, None, 9)).items
    ] == ["a1", "q1"]


async def test_a_deleted_message_leaves_its_branch_its_replies_follow_its_parent_and_search_forgets_it(
    memory_store,
):
    user = new_user()
    chat = await memory_store.create_chat(user, "items")
    root = await memory_store.append_message(user, message(chat.chat_id, "first"))
    middle = await memory_store.append_message(user, message(chat.chat_id, "zebra crossing", root))
    # Two replies to it (a regenerated answer): both follow its parent.
    reply = await memory_store.append_message(user, message(chat.chat_id, "one", middle, Role.ASSISTANT))
    other = await memory_store.append_message(user, message(chat.chat_id, "two", middle, Role.ASSISTANT))
    await memory_store.put_summary(
        user, chat.chat_id, ChatSummary("They spoke of a zebra.", 6, middle.message_id)
    )
    assert [h.message_id for h in (await memory_store.search_chats(user, "zebra")).items] == [
        middle.message_id
    ]

    await memory_store.delete_message(user, chat.chat_id, middle.message_id)
    branch = await memory_store.get_branch(user, chat.chat_id, None, with_summary=True)
    assert [m.content for m in branch.messages] == ["first", "two"] and branch.summary is None
    assert (await memory_store.get_message(user, chat.chat_id, reply.message_id)).parent_id == root.message_id
    # The tree's edges moved with them: the two replies are now the versions of root's reply.
    page = await memory_store.branch_page(user, chat.chat_id, other.message_id, None, 10)
    assert [(v.count, v.number) for v in page.versions] == [(2, 2), (1, 1)]
    assert page.versions[0].previous_id == reply.message_id
    page = await memory_store.branch_page(user, chat.chat_id, root.message_id, None, 10, newest_under=True)
    assert page.items[0].message_id == other.message_id
    assert (await memory_store.search_chats(user, "zebra")).items == []
    with pytest.raises(NotFound):
        await memory_store.get_message(user, chat.chat_id, middle.message_id)
    with pytest.raises(NotFound):
        await memory_store.delete_message(user, chat.chat_id, middle.message_id)
    with pytest.raises(NotFound):  # another user's chat
        await memory_store.delete_message(new_user(), chat.chat_id, other.message_id)
    # A root's replies become roots.
    await memory_store.delete_message(user, chat.chat_id, root.message_id)
    assert (await memory_store.get_message(user, chat.chat_id, other.message_id)).parent_id is None
