"""The edge's settings: one dataclass whose settings are the ``python -m edge`` flags (meshkit.config)."""

from __future__ import annotations

from dataclasses import dataclass

from chatmesh.identity import IdentityConfig
from chatmesh.limits import Limits
from edge.ops.settings import OpsSettings
from edge.sse import StreamSettings
from meshkit.config import nested, setting


@dataclass(frozen=True)
class EdgeSettings:
    # ChatService address: the orchestrator, or Envoy's internal listener in front of it.
    orchestrator: str = setting(
        "127.0.0.1:50050", "ChatService address host:port (orchestrator or Envoy's internal listener)"
    )
    unary_timeout_s: float = setting(10.0, "deadline of each unary ChatService call")
    # Upper bound on one stream's life (a run that long is stuck; clients can resume it).
    stream_timeout_s: float = setting(3600.0, "longest a single answer stream may stay open")
    # Largest request body accepted (OpenAI requests carry whole conversations). It protects the edge
    # only: the message limits are the orchestrator's, and this must stay above them.
    max_body_bytes: int = setting(1024 * 1024, "largest request body accepted (413 above it)")
    # Longer than Envoy's idle timeout for its connections to the edge (meshkit.envoy, 60 s), so Envoy
    # closes an idle connection first and never sends a request on one the edge is closing.
    keep_alive_s: int = setting(75, "seconds an idle HTTP connection (from Envoy) stays open")
    streams: StreamSettings = nested(StreamSettings)
    ops: OpsSettings = nested(OpsSettings)
    identity: IdentityConfig = nested(IdentityConfig)

    def __post_init__(self) -> None:
        if self.max_body_bytes < Limits().max_message_bytes:
            raise ValueError(
                f"--max-body-bytes ({self.max_body_bytes}) must hold at least one message of the "
                f"orchestrator's default --max-message-bytes ({Limits().max_message_bytes}); raise it with it"
            )
