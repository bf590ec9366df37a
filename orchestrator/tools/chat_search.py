"""The ``search_chats`` tool: the caller's own chats that mention every word of a query, through the
retrieval the ``SearchChats`` call uses (``memory_store.search``), bound to the caller's identity."""

from __future__ import annotations

from typing import Any

from chatmesh.tool_format import Function
from memory_store.errors import InvalidArgument
from memory_store.store import MemoryStore

# Hits a result lists (a result is also cut to --tool-max-result-chars).
MAX_HITS = 5

FUNCTION = Function(
    name="search_chats",
    description="Searches the user's earlier chats for messages containing every word of the query.",
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string", "description": "words to look for"}},
        "required": ["query"],
        "additionalProperties": False,
    },
)


class ChatSearch:
    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    async def __call__(self, user_id: str, arguments: dict[str, Any]) -> str:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be a non-empty string")
        try:
            page = await self.store.search_chats(user_id, query, limit=MAX_HITS)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        if not page.items:
            return f"No chat mentions {query!r}."
        return "\n".join(
            f"- chat {hit.chat_title!r} ({hit.created_at:%Y-%m-%d}), {hit.role}: {hit.snippet}"
            for hit in page.items
        )
