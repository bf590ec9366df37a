"""Who is calling: set by Envoy after JWT verification, read by the orchestrator.

Envoy strips any inbound copy of these headers, verifies the JWT, and copies its ``sub``, ``tier`` and
``role`` claims into them. Services trust only these headers, never a user id in a request body.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from chatmesh.tiers import DEFAULT_TIER, TIERS

USER_ID_HEADER = "x-chatmesh-user-id"
TIER_HEADER = "x-chatmesh-tier"
# The token's ``role`` claim, when it has one. Only the edge reads it: the operations page is for
# OPERATOR_ROLE alone.
ROLE_HEADER = "x-chatmesh-role"
OPERATOR_ROLE = "operator"
# Every header Envoy derives from a verified token (and strips from what clients send).
IDENTITY_HEADERS = (USER_ID_HEADER, TIER_HEADER, ROLE_HEADER)
# Not identity but routing: the chat a call concerns. Envoy's ring hash keeps one chat on one orchestrator
# replica; the edge sets it for chat-scoped calls, gRPC clients may set it themselves. Never trusted.
CHAT_ID_HEADER = "x-chatmesh-chat-id"
# The audience of every token meant for chatmesh; Envoy refuses tokens minted for anything else.
JWT_AUDIENCE = "chatmesh"


@dataclass(frozen=True)
class Identity:
    user_id: str
    tier: str


def identity_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Identity | None:
    """The caller's identity from gRPC invocation metadata, or None when Envoy set none.

    An unknown tier is treated as the default (lowest) tier rather than trusted.
    """
    values = {key.lower(): value for key, value in (metadata or ()) if isinstance(value, str)}
    user_id = values.get(USER_ID_HEADER, "").strip()
    if not user_id:
        return None
    tier = values.get(TIER_HEADER, DEFAULT_TIER).strip().lower()
    return Identity(user_id=user_id, tier=tier if tier in TIERS else DEFAULT_TIER)
