"""``python -m edge``: the HTTP/SSE edge in front of ChatService."""

from __future__ import annotations

import uvicorn

from chatmesh import telemetry
from chatmesh.config import ServiceArgs
from edge.app import create_app


def parse_args(argv: list[str] | None = None):
    args = ServiceArgs("edge", "REST + SSE for browsers and the OpenAI-compatible API, over ChatService.")
    args.add("host", "127.0.0.1", "address to listen on")
    args.add("port", 8081, "HTTP port")
    args.add("orchestrator", "127.0.0.1:50050", "orchestrator address host:port")
    args.add("drain-grace-s", 10.0, "seconds open streams get to finish after SIGTERM")
    return args.parse(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    telemetry.setup("edge")
    uvicorn.run(
        create_app(),
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=args.drain_grace_s,
        log_level="info",
    )


if __name__ == "__main__":
    main()
