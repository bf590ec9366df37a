"""The edge's settings: one dataclass, filled from ``python -m edge`` flags (see edge/__main__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge.sse import StreamSettings


@dataclass(frozen=True)
class EdgeSettings:
    # ChatService address: the orchestrator, or Envoy's internal listener in front of it.
    orchestrator: str = "127.0.0.1:50050"
    # Deadline of each unary ChatService call.
    unary_timeout_s: float = 10.0
    # Upper bound on one stream's life (a run that long is stuck; clients can resume it).
    stream_timeout_s: float = 3600.0
    # Largest request body accepted (OpenAI requests carry whole conversations).
    max_body_bytes: int = 1024 * 1024
    streams: StreamSettings = field(default_factory=StreamSettings)
