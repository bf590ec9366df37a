"""Tools from the MCP servers an operator configures (docs/tools.md, "MCP servers"): each server's tool
list, fetched at start and refreshed, offered as ``SERVER.TOOL``; a call sent with the step's
idempotency key in its ``_meta``, its result read as text.

One task per server owns its connection (``McpServer.keep``): it connects (streamable HTTP, with the
credentials read from ``--mcp-credentials-dir`` at each connection), lists the tools, and lists them
again every ``--mcp-refresh-s``. A server that does not answer has no tools until it does: its task
retries, sooner at first, and ``chatmesh_orchestrator_mcp_server_up`` says which servers are up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import httpx2
import llguidance
import mcp_types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from chatmesh.tool_format import Function, Tools
from orchestrator.metrics import METRICS
from orchestrator.tools.toolbox import Tool

log = logging.getLogger(__name__)

# Where a call carries its idempotency key (the step's call id, a function of the run and the step):
# MCP defines no such key, so it goes in the request's `_meta` (docs/tools.md, "MCP servers").
IDEMPOTENCY_KEY = "chatmesh/idempotency-key"
# What one server may add to every answer's system prompt and grammar: its tools beyond the first
# MAX_TOOLS are left out, a longer description is cut, a tool whose arguments' schema is longer, or
# does not compile to a grammar, is left out (logged): one odd tool must not break every answer.
MAX_TOOLS = 64
MAX_PAGES = 8
MAX_NAME_CHARS = 64
MAX_DESCRIPTION_CHARS = 1024
MAX_SCHEMA_CHARS = 8 * 1024
# A server that does not answer is tried again after this, then twice as long each time, up to the
# refresh period.
FIRST_RETRY_S = 1.0
CONNECT_TIMEOUT_S = 10.0
# HTTP reads: a server may hold a stream open, idle, for its notifications (the SDK's own default);
# a call and a listing are bounded by their own timeouts.
READ_TIMEOUT_S = 300.0


class McpServer:
    """One MCP server: its connection, owned by the ``keep`` task, and the tools it listed last."""

    def __init__(
        self, name: str, url: str, credentials_dir: str, refresh_s: float, call_timeout_s: float
    ) -> None:
        self.name = name
        self.url = url
        self.credentials_dir = credentials_dir
        self.refresh_s = refresh_s
        self.call_timeout_s = call_timeout_s
        # By namespaced name (SERVER.TOOL), in the order the server listed them.
        self.tools: dict[str, Tool] = {}
        self._client: Client | None = None
        # Each tool as listed (JSON) to what it became, so a listing is checked (its grammar compiled)
        # and a tool left out is logged once, not at every refresh.
        self._seen: dict[str, Tool | None] = {}
        METRICS.mcp_server_up.labels(name).set(0)

    def headers(self) -> dict[str, str]:
        """The headers every request to the server carries: NAME.token as a bearer token, and
        NAME.headers' ``Header: value`` lines, from the credentials directory (read anew at each
        connection, so a rotated Secret takes effect at the next one)."""
        headers: dict[str, str] = {}
        if not self.credentials_dir:
            return headers
        folder = Path(self.credentials_dir)
        with contextlib.suppress(FileNotFoundError):
            for line in (folder / f"{self.name}.headers").read_text().splitlines():
                header, sep, value = line.partition(":")
                if sep and header.strip():
                    headers[header.strip()] = value.strip()
        with contextlib.suppress(FileNotFoundError):
            if token := (folder / f"{self.name}.token").read_text().strip():
                headers["Authorization"] = f"Bearer {token}"
        return headers

    async def keep(self) -> None:
        """Connects, lists the server's tools, and lists them again every refresh period; after a
        failure, connects again. Runs until cancelled."""
        retry_s = FIRST_RETRY_S
        while True:
            try:
                timeout = httpx2.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S)
                async with (
                    httpx2.AsyncClient(headers=self.headers(), timeout=timeout) as http,
                    Client(
                        streamable_http_client(self.url, http_client=http),
                        read_timeout_seconds=self.call_timeout_s,
                        cache=None,
                    ) as client,
                ):
                    while True:
                        async with asyncio.timeout(CONNECT_TIMEOUT_S + self.call_timeout_s):
                            listed = await _list_tools(client)
                        self._publish(client, listed)
                        retry_s = FIRST_RETRY_S
                        await asyncio.sleep(self.refresh_s)
            except Exception as exc:
                if self._client is not None or retry_s == FIRST_RETRY_S:
                    log.warning("MCP server %s (%s) does not answer: %s", self.name, self.url, _reason(exc))
            self._withdraw()
            await asyncio.sleep(retry_s)
            retry_s = min(2 * retry_s, self.refresh_s)

    def _publish(self, client: Client, listed: Sequence[mcp_types.Tool]) -> None:
        tools: dict[str, Tool] = {}
        seen: dict[str, Tool | None] = {}
        for each in listed[:MAX_TOOLS]:
            key = each.model_dump_json()
            seen[key] = self._seen[key] if key in self._seen else self._tool(each)
            if (tool := seen[key]) is not None:
                tools[tool.function.name] = tool
        if self._client is None or list(tools) != list(self.tools):
            left_out = (
                f" (it lists {len(listed)}, at most {MAX_TOOLS} are read)" if len(listed) > MAX_TOOLS else ""
            )
            log.info("MCP server %s is up: tools %s%s", self.name, sorted(tools), left_out)
        self._seen = seen
        self._client, self.tools = client, tools
        METRICS.mcp_server_up.labels(self.name).set(1)
        METRICS.mcp_server_tools.labels(self.name).set(len(tools))

    def _withdraw(self) -> None:
        self._client, self.tools = None, {}
        METRICS.mcp_server_up.labels(self.name).set(0)
        METRICS.mcp_server_tools.labels(self.name).set(0)

    def _tool(self, listed: mcp_types.Tool) -> Tool | None:
        """The tool as the model is offered it, or None (logged) when it cannot be offered."""
        name = f"{self.name}.{listed.name}"
        schema = listed.input_schema
        function = Function(name, (listed.description or listed.title or "")[:MAX_DESCRIPTION_CHARS], schema)
        problem = ""
        if len(listed.name) > MAX_NAME_CHARS:
            problem = f"its name is longer than {MAX_NAME_CHARS} characters"
        elif len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
            problem = f"its input schema is longer than {MAX_SCHEMA_CHARS} characters"
        elif error := _grammar_problem(function):
            problem = f"its input schema does not compile: {error[:200]}"
        if problem:
            log.warning(
                "MCP server %s: tool %r left out: %s", self.name, listed.name[:MAX_NAME_CHARS], problem
            )
            return None

        async def run(_user_id: str, arguments: dict[str, Any], key: str) -> str:
            return await self.call(listed.name, arguments, key)

        return Tool(function, run)

    async def call(self, tool: str, arguments: dict[str, Any], key: str) -> str:
        """Calls ``tool`` (the server's own name); the result's text. A ValueError (shown to the model)
        when the server is not connected, refuses the call, or the tool reports an error."""
        client = self._client
        if client is None:
            raise ValueError(f"the tool's server ({self.name}) is not reachable now")
        try:
            meta = cast(mcp_types.RequestParamsMeta, {IDEMPOTENCY_KEY: key})  # an open map (PEP 728)
            result = await client.call_tool(
                tool, arguments, read_timeout_seconds=self.call_timeout_s, meta=meta
            )
        except MCPError as exc:
            if exc.error.code == mcp_types.INVALID_PARAMS:  # the server's words on the model's arguments
                raise ValueError(
                    f"the tool's server refused the arguments: {exc.error.message[:500]}"
                ) from None
            # Anything else may be the transport's own words (addresses): logged, not shown.
            log.warning("MCP server %s: %s failed: %s", self.name, tool, exc.error.message[:300])
            raise ValueError("the tool's server did not complete the call") from None
        text = result_text(result)
        if result.is_error:
            raise ValueError(text or "the tool reported an error")
        return text


def result_text(result: mcp_types.CallToolResult) -> str:
    """A call's result as the model reads it: text only (an image, audio or a binary resource is named,
    not included); structured content, as JSON, where there is no text."""
    parts = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.EmbeddedResource) and isinstance(
            block.resource, mcp_types.TextResourceContents
        ):
            parts.append(block.resource.text)
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{block.type} content left out: only text is read]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


async def _list_tools(client: Client) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if cursor is None or len(tools) >= MAX_TOOLS:
            break
    return tools


def _grammar_problem(function: Function) -> str:
    """Why a tool's call grammar does not compile ("" if it does): checked before it is offered, since
    the engine refuses an answer whose grammar does not compile."""
    grammar = Tools((function,), "auto", parallel=False).constraint().grammar
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))


def _reason(exc: BaseException) -> str:
    """The first real failure in ``exc`` (the SDK raises exception groups from its task groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:300]


class McpServers:
    """Every configured MCP server, and the tasks that keep them."""

    def __init__(self, servers: Sequence[McpServer]) -> None:
        self.servers = {server.name: server for server in servers}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for server in self.servers.values():
            self._tasks.append(asyncio.create_task(server.keep(), name=f"mcp-{server.name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def tool(self, name: str) -> Tool | None:
        server = self.servers.get(name.partition(".")[0])
        return server.tools.get(name) if server is not None else None

    def tools_of(self, server: str) -> list[Tool]:
        return list(self.servers[server].tools.values())
