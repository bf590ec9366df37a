"""The orchestrator's tools, as one answer may use them: which a tier may call, each call run under a
timeout, its result cut to size and every failure made a result the model reads (docs/tools.md). The
tools are the built-in ones and those the MCP servers list now (``orchestrator.tools.mcp_servers``).

A call's outcome is one of ``ok``, ``error`` (bad arguments, or the tool failed), ``timeout``,
``refused`` (a tool this tier may not call, or none of that name) and ``interrupted`` (the replica
running it was lost: ``Toolbox.interrupted``, never a second run).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from chatmesh.tool_format import Function, ToolCall, Tools
from memory_store.store import MemoryStore
from orchestrator.config import ToolConfig
from orchestrator.metrics import METRICS, TOOL_OUTCOMES
from orchestrator.tools import calculator, chat_search, clock

log = logging.getLogger(__name__)

# A tool: the caller's user id, the call's arguments and the step's idempotency key (its call id, a
# function of the run and the step) in, the result's text out (a ValueError's message is shown to the
# model; any other exception is logged and shown as a failure).
Run = Callable[[str, dict[str, Any], str], Awaitable[str]]
# An allow-list entry naming every tool of an MCP server: SERVER.*
EVERY_TOOL = ".*"

INTERRUPTED_TEXT = (
    "The tool was interrupted: the server running it was lost. It may or may not have taken effect, "
    "and it is not run again."
)


# The last line of the grammar of the tools the orchestrator offers an answer (a Lark comment): it tells
# a run offered them from one constrained to a caller's own tools (which the caller runs), whatever
# tools it names, as the MCP servers' tools come and go.
OFFERED_MARK = "// chatmesh: tools the orchestrator runs"


def offered_grammar(tools: Tools) -> str:
    """The grammar of an answer offered ``tools`` (``tools_for``'s)."""
    return f"{tools.constraint().grammar}\n{OFFERED_MARK}"


def offers_tools(grammar: str) -> bool:
    """Whether a run whose first turn has ``grammar`` was offered the orchestrator's tools."""
    return grammar.endswith(f"\n{OFFERED_MARK}")


@dataclass(frozen=True)
class Tool:
    function: Function
    run: Run


class RemoteTools(Protocol):
    """Tools other processes serve, by server (``mcp_servers.McpServers``): known only while it answers."""

    @property
    def servers(self) -> Mapping[str, object]: ...

    def tool(self, name: str) -> Tool | None: ...

    def tools_of(self, server: str) -> list[Tool]: ...


@dataclass(frozen=True)
class StepResult:
    """What a tool step gave the model."""

    call_id: str
    tool: str
    outcome: str  # ok | error | timeout | refused | interrupted
    text: str


def builtin_tools(store: MemoryStore) -> dict[str, Tool]:
    search = chat_search.ChatSearch(store)
    return {
        tool.function.name: tool
        for tool in (
            Tool(calculator.FUNCTION, lambda _user, arguments, _key: calculator.calculator(arguments)),
            Tool(clock.FUNCTION, lambda _user, arguments, _key: clock.clock(arguments)),
            Tool(chat_search.FUNCTION, lambda user, arguments, _key: search(user, arguments)),
        )
    }


class Toolbox:
    def __init__(
        self,
        config: ToolConfig,
        tools: dict[str, Tool],
        tiers: tuple[str, ...],
        mcp: RemoteTools | None = None,
    ) -> None:
        """Raises ValueError when an allow-list names a built-in tool there is none of, or an MCP server
        not configured (a typo would otherwise take a tool away silently). An MCP server's tools are
        known only once it answers: SERVER.TOOL is offered while SERVER lists TOOL."""
        self.config = config
        self.tools = tools
        self.mcp = mcp
        servers = set(mcp.servers) if mcp is not None else set()
        self._allowed: dict[str, tuple[str, ...]] = {}
        for tier in tiers:
            names = config.allowed_for(tier)
            if unknown := [n for n in names if n not in tools and n.partition(".")[0] not in servers]:
                raise ValueError(
                    f"--tools-{tier} names unknown tools {unknown}; known: {sorted(tools)}, and SERVER.TOOL "
                    f"or SERVER.* of the MCP servers {sorted(servers)}"
                )
            self._allowed[tier] = names
        # Each tool's series from 0: a dashboard's rate of a call that never happened reads 0, not no data.
        for name in tools:
            METRICS.tool_duration.labels(name)
            for outcome in TOOL_OUTCOMES:
                METRICS.tool_calls.labels(name, outcome)

    def tools_for(self, tier: str, steps_taken: int) -> Tools | None:
        """The tools an answer of ``tier`` is offered after ``steps_taken`` steps (None: answer in text):
        its allow-list's built-in tools, and those of its MCP tools their servers list now."""
        if not self.config.enabled or steps_taken >= self.config.max_steps:
            return None
        offered = [tool.function for tool in self._allowed_tools(tier)]
        return Tools(tuple(offered), "auto", parallel=False) if offered else None

    def _allowed_tools(self, tier: str) -> list[Tool]:
        tools: dict[str, Tool] = {}  # in the allow-list's order, each once
        for name in self._allowed.get(tier, ()):
            if name in self.tools:
                tools[name] = self.tools[name]
            elif self.mcp is None:
                continue
            elif name.endswith(EVERY_TOOL):
                tools |= {t.function.name: t for t in self.mcp.tools_of(name.removesuffix(EVERY_TOOL))}
            elif (tool := self.mcp.tool(name)) is not None:
                tools[name] = tool
        return list(tools.values())

    def _allows(self, tier: str, name: str) -> bool:
        allowed = self._allowed.get(tier, ())
        server, dot, _ = name.partition(".")
        return name in allowed or (bool(dot) and f"{server}{EVERY_TOOL}" in allowed)

    def _tool(self, name: str) -> Tool | None:
        if name in self.tools:
            return self.tools[name]
        return self.mcp.tool(name) if self.mcp is not None else None

    def interrupted(self, call: ToolCall) -> StepResult:
        """The result of a step found started but never finished (or started by another replica): the
        tool is not run again."""
        METRICS.tool_calls.labels(self._metric_name(call), "interrupted").inc()
        return StepResult(call.id, call.name, "interrupted", INTERRUPTED_TEXT)

    def _metric_name(self, call: ToolCall) -> str:
        # The model's names are not bounded (an MCP server's are: MAX_TOOLS each).
        return call.name if self._tool(call.name) is not None else "unknown"

    async def run(self, user_id: str, tier: str, call: ToolCall) -> StepResult:
        """Runs one call; never raises (but for cancellation): a failure is a result."""
        started, metric_name = time.monotonic(), self._metric_name(call)
        outcome, text = await self._outcome(user_id, tier, call)
        if len(text) > self.config.max_result_chars:
            cut = self.config.max_result_chars - 40
            text = f"{text[:cut]}\n[result cut at {cut} characters]"
        METRICS.tool_calls.labels(metric_name, outcome).inc()
        if outcome != "refused":
            METRICS.tool_duration.labels(metric_name).observe(time.monotonic() - started)
        return StepResult(call.id, call.name, outcome, text)

    async def _outcome(self, user_id: str, tier: str, call: ToolCall) -> tuple[str, str]:
        if not self._allows(tier, call.name):
            return "refused", f"There is no tool {call.name[:64]!r} you may call."
        tool = self._tool(call.name)
        if tool is None:  # an MCP server's tool, its server down or no longer listing it
            return "error", f"The tool {call.name[:64]!r} is not available now."
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            return "error", "The arguments are not JSON."
        if not isinstance(arguments, dict):
            return "error", "The arguments must be a JSON object."
        try:
            async with asyncio.timeout(self.config.timeout_s):
                return "ok", await tool.run(user_id, arguments, call.id)
        except TimeoutError:
            return "timeout", f"The tool did not answer within {self.config.timeout_s:g} s."
        except ValueError as exc:
            return "error", f"Error: {exc}"
        except Exception as exc:
            log.warning("tool %s failed: %s", call.name, exc, exc_info=exc)
            return "error", "The tool failed."
