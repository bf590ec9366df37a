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
    # The orchestrator replicas, each reached by the edge itself (a list, or a dns:/// name with one
    # address per replica: the edge keeps a chat on one).
    orchestrator: str = setting(
        "127.0.0.1:50050",
        "the orchestrator replicas: host:port, host:port,host:port, or dns:///name:port (one address per "
        "replica, a headless Service)",
    )
    # Every call and answer stream goes on CompleteMany streams to each replica, whose messages carry the
    # events of every answer on them (a stored chat's on a link of its chat's replica), and start the
    # requests of one message in one turn of the replica's loop, where its gRPC server accepts one new
    # call a turn.
    completion_links: int = setting(
        4,
        "CompleteMany streams to each orchestrator replica, which carry every call and answer of the edge's",
    )
    # gRPC sheds a call the orchestrator has not taken within its --max-pending-s (30 s); an answer on a
    # link is not a call, so the edge refuses it itself (503, too busy) after as long.
    completion_start_timeout_s: float = setting(
        30.0, "longest an answer on a completion link waits for its run to start (then 503, too busy)"
    )
    unary_timeout_s: float = setting(10.0, "deadline of each unary ChatService call")
    # Upper bound on one stream's life (a run that long is stuck; clients can resume it).
    stream_timeout_s: float = setting(3600.0, "longest a single answer stream may stay open")
    # Largest request body accepted (OpenAI requests carry whole conversations). It protects the edge
    # only: the message limits are the orchestrator's, and this must stay above them.
    max_body_bytes: int = setting(1024 * 1024, "largest request body accepted (413 above it)")
    # Envoy sends every stream to an edge over a few HTTP/2 connections (this many streams each); HTTP/1.1
    # clients hold a connection per request, up to max_connections.
    http2_max_streams: int = setting(1000, "most concurrent requests on one HTTP/2 connection (from Envoy)")
    max_connections: int = setting(
        20_000, "most connections served at once (HTTP/1.1 clients hold one per open stream)"
    )
    streams: StreamSettings = nested(StreamSettings)
    ops: OpsSettings = nested(OpsSettings)
    identity: IdentityConfig = nested(IdentityConfig)

    def __post_init__(self) -> None:
        if self.completion_links < 1:
            raise ValueError(f"--completion-links must be at least 1, not {self.completion_links}")
        if self.max_body_bytes < Limits().max_message_bytes:
            raise ValueError(
                f"--max-body-bytes ({self.max_body_bytes}) must hold at least one message of the "
                f"orchestrator's default --max-message-bytes ({Limits().max_message_bytes}); raise it with it"
            )
