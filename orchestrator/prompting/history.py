"""What a prompt is assembled from: the branch being continued, and the chat's summary if it applies.

The branch is the path from the root to the message being answered (edits and regenerations are
siblings, so other branches never leak in). A chat keeps one rolling summary, of the branch it was
made for: it applies when the branch (its newest ``max_messages``) holds the newest message it covers;
then only the messages after that go in verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatmesh.tokenizer import ChatMessage
from chatmesh.tool_format import result_text, with_calls
from memory_store.models import Chat, ChatSummary, Message, Role
from memory_store.store import MemoryStore


@dataclass(frozen=True)
class History:
    # Oldest first; after the summary's last message when the summary applies.
    messages: list[Message]
    # The summary of everything before ``messages``, when it belongs to this branch.
    summary: ChatSummary | None
    # The message the branch ends at (None: none, a new root).
    leaf_id: str | None
    # The chat, as read with the branch (so the caller's).
    chat: Chat


async def load_history(
    store: MemoryStore, user_id: str, chat_id: str, leaf_id: str | None, max_messages: int
) -> History:
    """The branch ending at ``leaf_id`` (None: the chat's newest message), after the chat's summary if
    it covers this branch. The branch and the summary are read at once (one round trip for a chat
    active today), so the walk cannot stop at the summary: it reads up to ``max_messages`` and the
    messages the summary covers are dropped here."""
    branch = await store.get_branch(user_id, chat_id, leaf_id, max_messages=max_messages, with_summary=True)
    summary = branch.summary
    leaf = branch.messages[-1].message_id if branch.messages else None
    ids = [m.message_id for m in branch.messages]
    if summary is None or summary.through_message_id not in ids:
        return History(branch.messages, None, leaf, branch.chat)
    return History(branch.messages[ids.index(summary.through_message_id) + 1 :], summary, leaf, branch.chat)


def turns(messages: list[Message]) -> list[ChatMessage]:
    """Messages as chat-template turns, tool calls and results in the model's tool-call format (a result
    is a user turn, as the model read it); answers that ended with no text and no call (e.g. filtered)
    are left out."""
    out = []
    for m in messages:
        if m.role is Role.TOOL:
            out.append(ChatMessage("user", result_text(m.content)))
        elif text := with_calls(m.content, [(call.name, call.arguments) for call in m.tool_calls]):
            out.append(ChatMessage(m.role.value, text))
    return out
