"""Who a ChatService call from the edge is for: the caller's verified identity, the token passed on, and
the chat the call concerns (which places it on that chat's replica)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from chatmesh.identity import Identity


@dataclass(frozen=True, kw_only=True)
class Caller:
    """Who a call is for, proven by their token, and which chat it concerns."""

    identity: Identity
    # The caller's `Authorization` value, verified here and passed on: the orchestrator verifies it again.
    authorization: str
    chat_id: str = ""

    def for_chat(self, chat_id: str) -> Caller:
        """The same caller, for a call about ``chat_id``."""
        return replace(self, chat_id=chat_id)
