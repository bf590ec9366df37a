"""What a prompt continues (``prompting.history.load_history``) on a real Cassandra node: the branch and
the chat's summary, read at once, and the summary applied only to the branch it was made for."""

from memory_store.models import ChatSummary
from orchestrator.prompting.history import load_history
from tests.memory_store.builders import message, new_user, regenerated_tree


async def test_a_summary_covers_its_own_branch_only_and_the_newest_message_is_the_default_leaf(memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "summarized")
    tree = await regenerated_tree(memory_store, user, chat.chat_id)
    a1, a1_again, a2 = tree["a1"], tree["a1 regenerated"], tree["a2"]

    plain = await load_history(memory_store, user, chat.chat_id, None, 400)
    assert [m.content for m in plain.messages] == ["q1", "a1 regenerated", "q2", "a2"]
    assert plain.summary is None and plain.leaf_id == a2.message_id and plain.chat.chat_id == chat.chat_id

    # A summary through a1_again: only what comes after it is read verbatim, and the leaf stays a2.
    await memory_store.put_summary(user, chat.chat_id, ChatSummary("q1, answered", 3, a1_again.message_id))
    after = await load_history(memory_store, user, chat.chat_id, None, 400)
    assert [m.content for m in after.messages] == ["q2", "a2"]
    assert after.summary is not None and after.summary.text == "q1, answered"
    assert after.leaf_id == a2.message_id

    # The branch through a1 (the regenerated answer's sibling) never meets the summary: it goes whole.
    q3 = await memory_store.append_message(user, message(chat.chat_id, "q3 on the first branch", a1))
    elsewhere = await load_history(memory_store, user, chat.chat_id, q3.message_id, 400)
    assert [m.content for m in elsewhere.messages] == ["q1", "a1", "q3 on the first branch"]
    assert elsewhere.summary is None

    # A summary older than the newest max_messages of the branch does not apply either.
    truncated = await load_history(memory_store, user, chat.chat_id, a2.message_id, 2)
    assert [m.content for m in truncated.messages] == ["q2", "a2"] and truncated.summary is None
