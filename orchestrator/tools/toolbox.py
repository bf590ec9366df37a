"""The orchestrator's tools, as one answer may use them: which a tier may call, each call run under a
timeout, its result cut to size and every failure made a result the model reads (docs/tools.md).

A call's outcome is one of ``ok``, ``error`` (bad arguments, or the tool failed), ``timeout``,
``refused`` (a tool this tier may not call, or none of that name) and ``interrupted`` (the replica
running it was lost: ``Toolbox.interrupted``, never a second run).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from chatmesh.tool_format import Function, ToolCall, Tools
from memory_store.store import MemoryStore
from orchestrator.config import ToolConfig
from orchestrator.metrics import METRICS, TOOL_OUTCOMES
from orchestrator.tools import calculator, chat_search, clock

log = logging.getLogger(__name__)

# A tool: the caller's user id and the call's arguments in, the result's text out (a ValueError's
# message is shown to the model; any other exception is logged and shown as a failure).
Run = Callable[[str, dict[str, Any]], Awaitable[str]]

INTERRUPTED_TEXT = (
    "The tool was interrupted: the server running it was lost. It may or may not have taken effect, "
    "and it is not run again."
)


@dataclass(frozen=True)
class Tool:
    function: Function
    run: Run


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
            Tool(calculator.FUNCTION, lambda _user, arguments: calculator.calculator(arguments)),
            Tool(clock.FUNCTION, lambda _user, arguments: clock.clock(arguments)),
            Tool(chat_search.FUNCTION, search),
        )
    }


class Toolbox:
    def __init__(self, config: ToolConfig, tools: dict[str, Tool], tiers: tuple[str, ...]) -> None:
        """Raises ValueError when an allow-list names a tool there is none of (a typo would otherwise
        take a tool away silently)."""
        self.config = config
        self.tools = tools
        self._allowed: dict[str, tuple[str, ...]] = {}
        for tier in tiers:
            names = config.allowed_for(tier)
            if unknown := [name for name in names if name not in tools]:
                raise ValueError(f"--tools-{tier} names unknown tools {unknown}; known: {sorted(tools)}")
            self._allowed[tier] = names
        # Each tool's series from 0: a dashboard's rate of a call that never happened reads 0, not no data.
        for name in tools:
            METRICS.tool_duration.labels(name)
            for outcome in TOOL_OUTCOMES:
                METRICS.tool_calls.labels(name, outcome)

    def tools_for(self, tier: str, steps_taken: int) -> Tools | None:
        """The tools an answer of ``tier`` is offered after ``steps_taken`` steps (None: answer in text)."""
        allowed = self._allowed.get(tier, ())
        if not self.config.enabled or not allowed or steps_taken >= self.config.max_steps:
            return None
        return Tools(tuple(self.tools[name].function for name in allowed), "auto", parallel=False)

    def interrupted(self, call: ToolCall) -> StepResult:
        """The result of a step found started but never finished (or started by another replica): the
        tool is not run again."""
        METRICS.tool_calls.labels(self._metric_name(call), "interrupted").inc()
        return StepResult(call.id, call.name, "interrupted", INTERRUPTED_TEXT)

    def _metric_name(self, call: ToolCall) -> str:
        return call.name if call.name in self.tools else "unknown"  # the model's names are not bounded

    async def run(self, user_id: str, tier: str, call: ToolCall) -> StepResult:
        """Runs one call; never raises (but for cancellation): a failure is a result."""
        started = time.monotonic()
        outcome, text = await self._outcome(user_id, tier, call)
        if len(text) > self.config.max_result_chars:
            cut = self.config.max_result_chars - 40
            text = f"{text[:cut]}\n[result cut at {cut} characters]"
        METRICS.tool_calls.labels(self._metric_name(call), outcome).inc()
        if outcome != "refused":
            METRICS.tool_duration.labels(call.name).observe(time.monotonic() - started)
        return StepResult(call.id, call.name, outcome, text)

    async def _outcome(self, user_id: str, tier: str, call: ToolCall) -> tuple[str, str]:
        if call.name not in self._allowed.get(tier, ()):
            return "refused", f"There is no tool {call.name[:64]!r} you may call."
        tool = self.tools[call.name]
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            return "error", "The arguments are not JSON."
        if not isinstance(arguments, dict):
            return "error", "The arguments must be a JSON object."
        try:
            async with asyncio.timeout(self.config.timeout_s):
                return "ok", await tool.run(user_id, arguments)
        except TimeoutError:
            return "timeout", f"The tool did not answer within {self.config.timeout_s:g} s."
        except ValueError as exc:
            return "error", f"Error: {exc}"
        except Exception as exc:
            log.warning("tool %s failed: %s", call.name, exc, exc_info=exc)
            return "error", "The tool failed."
