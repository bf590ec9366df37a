"""What a prompt is assembled from: the branch being continued, and the chat's summary if it applies.

The branch is the path from the root to the message being answered (edits and regenerations are
siblings, so other branches never leak in). A chat keeps one rolling summary, of the branch it was
made for: it applies when the walk from the leaf meets the newest message it covers; then only the
messages after that are read verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatmesh.tokenizer import ChatMessage
from memory_store.models import ChatSummary, Message
from memory_store.store import MemoryStore


@dataclass(frozen=True)
class History:
    # Oldest first; after the summary's last message when the summary applies.
    messages: list[Message]
    # The summary of everything before ``messages``, when it belongs to this branch.
    summary: ChatSummary | None


async def load_history(
    store: MemoryStore,
    user_id: str,
    chat_id: str,
    leaf_id: str | None,
    max_messages: int,
    summary: ChatSummary | None,
) -> History:
    """The branch ending at ``leaf_id`` (None: an empty history, e.g. a chat's first message), after
    the chat's ``summary`` (read by the caller, alongside its other reads) if it covers this branch."""
    if leaf_id is None:
        return History([], None)
    branch = await store.get_branch(
        user_id,
        chat_id,
        leaf_id,
        stop_at=summary.through_message_id if summary else None,
        max_messages=max_messages,
    )
    return History(branch.messages, summary if branch.reached_stop else None)


def turns(messages: list[Message]) -> list[ChatMessage]:
    """Messages as chat-template turns; answers that ended with no text (e.g. filtered) are left out."""
    return [ChatMessage(m.role.value, m.content) for m in messages if m.content]
