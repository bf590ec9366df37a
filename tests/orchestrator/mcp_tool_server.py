"""A real MCP server for the tests of the orchestrator's MCP tools (the SDK's ``MCPServer``, formerly
FastMCP, over streamable HTTP on a port of its own), run as a separate process:

    python -m tests.orchestrator.mcp_tool_server --port P --calls FILE [--delay-s S]

Its tools: ``record`` writes each call as it arrives (its text, the idempotency key in the request's
``_meta``, the Authorization header) as a JSON line to FILE, then answers after ``--delay-s``, so a
test can tell that a call reached it, how often, and with what; ``fails`` reports an error; ``picture``
answers text and an image; ``odd`` and ``huge`` list schemas the orchestrator cannot offer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import mcp_types
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from orchestrator.tools.mcp_servers import IDEMPOTENCY_KEY

RECORD_DESCRIPTION = "Writes the text down."


def server(calls: Path, delay_s: float) -> MCPServer:
    app = MCPServer("chatmesh-test-tools")

    @app.tool(description=RECORD_DESCRIPTION)
    async def record(text: str, ctx: Context) -> str:
        meta = ctx.request_context.meta or {}
        headers = ctx.headers or {}
        line = {"text": text, "key": meta.get(IDEMPOTENCY_KEY), "authorization": headers.get("authorization")}
        with calls.open("a") as file:
            file.write(json.dumps(line) + "\n")
        await asyncio.sleep(delay_s)
        return f"recorded {text!r}"

    @app.tool(description="Always fails.")
    async def fails() -> str:
        raise ToolError("the disk is full")

    @app.tool(description="A caption and a picture.")
    async def picture() -> list[mcp_types.ContentBlock]:
        return [
            mcp_types.TextContent(type="text", text="a red dot"),
            mcp_types.ImageContent(type="image", data="iVBORw0KGgo=", mime_type="image/png"),
        ]

    # Two tools the orchestrator must leave out: arguments whose schema does not compile to a grammar,
    # and a schema over its size cap (the SDK derives schemas from type hints: these are set after).
    @app.tool(description="Its schema is wrong.")
    async def odd(x: str) -> str:
        return x

    @app.tool(description="Its schema is too long.")
    async def huge(x: str) -> str:
        return x

    manager = app._tool_manager  # the SDK has no public way to list a schema of one's own
    manager.get_tool("odd").parameters = {"type": "object", "properties": {"x": {"type": "strin"}}}
    fields = {f"field_{i}": {"type": "string", "description": "x" * 100} for i in range(100)}
    manager.get_tool("huge").parameters = {"type": "object", "properties": fields}
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--calls", type=Path, required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    server(args.calls, args.delay_s).run("streamable-http", host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
