"""The orchestrator's own tools (orchestrator/tools): the calculator evaluates arithmetic and nothing
else, within bounds; the clock; the chat search over the session's Cassandra; and the toolbox's rules,
where every failure is a result."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest

from chatmesh.tool_format import Function, ToolCall
from orchestrator.config import ToolConfig
from orchestrator.metrics import METRICS
from orchestrator.tools.calculator import CalculatorError, evaluate
from orchestrator.tools.chat_search import ChatSearch
from orchestrator.tools.clock import clock
from orchestrator.tools.toolbox import Tool, Toolbox, builtin_tools
from tests.memory_store.builders import message, new_user

TIERS = ("free", "pro", "enterprise")


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("-(2.5)", -2.5),
        ("2 ** -1", 0.5),
        ("12345678901234567890 * 98765432109876543210", 12345678901234567890 * 98765432109876543210),
    ],
)
def test_calculator_does_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "not arithmetic"),
        ("(1).__class__", "not arithmetic"),
        ("x + 1", "not arithmetic"),
        ("[1, 2]", "not arithmetic"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 if 1 else 2", "not arithmetic"),
        ("lambda: 1", "not arithmetic"),
        ("1 +", "not arithmetic"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "too large"),
        ("2 ** 10001", "too large"),
        ("10.0 ** 400", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1" + " + 1" * 300, "longer than"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)


async def test_clock_tells_the_time_in_the_zone_named():
    before = datetime.now(UTC).replace(microsecond=0)
    told = await clock({})
    assert datetime.fromisoformat(told.split(" ")[0]) >= before
    assert told.split(" ")[0].endswith("+00:00")
    tokyo = await clock({"timezone": "Asia/Tokyo"})
    assert "(" in tokyo and "+09:00" in tokyo
    with pytest.raises(ValueError, match="unknown timezone"):
        await clock({"timezone": "Mars/Olympus"})


def _toolbox(config: ToolConfig | None = None, extra: dict[str, Tool] | None = None) -> Toolbox:
    tools = {**builtin_tools(store=None), **(extra or {})}  # type: ignore[arg-type]  # search unused
    return Toolbox(config or ToolConfig(enabled=True), tools, TIERS)


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(f"call_{name}", name, json.dumps(arguments))


def _counted(tool: str, outcome: str) -> float:
    return METRICS.tool_calls.labels(tool, outcome)._value.get()


def test_each_tier_is_offered_its_allowed_tools_until_the_step_cap():
    box = _toolbox(ToolConfig(enabled=True, max_steps=2))
    free = box.tools_for("free", 0)
    assert free is not None and [f.name for f in free.functions] == ["calculator", "clock"]
    assert free.choice == "auto" and not free.parallel
    pro = box.tools_for("pro", 1)
    assert pro is not None and "search_chats" in [f.name for f in pro.functions]
    assert box.tools_for("pro", 2) is None
    assert _toolbox(ToolConfig(enabled=False)).tools_for("pro", 0) is None


def test_an_allow_list_naming_an_unknown_tool_is_refused_at_start():
    with pytest.raises(ValueError, match="--tools-free names unknown tools"):
        _toolbox(ToolConfig(allowed={"free": "calculator,calculater", "pro": "", "enterprise": ""}))


async def test_a_call_is_run_and_counted():
    before = _counted("calculator", "ok")
    result = await _toolbox().run("u1", "free", _call("calculator", expression="6 * 7"))
    assert (result.outcome, result.text, result.call_id) == ("ok", "42", "call_calculator")
    assert _counted("calculator", "ok") == before + 1


async def test_failures_are_results_the_model_reads():
    box = _toolbox()
    refused = await box.run("u1", "free", _call("search_chats", query="x"))
    assert refused.outcome == "refused" and "no tool 'search_chats'" in refused.text
    unknown = await box.run("u1", "free", _call("rm_rf"))
    assert unknown.outcome == "refused"
    bad = await box.run("u1", "free", _call("calculator", expression="open('/etc/passwd')"))
    assert bad.outcome == "error" and "not arithmetic" in bad.text
    not_json = await box.run("u1", "free", ToolCall("c", "calculator", "{nope"))
    assert not_json.outcome == "error"


async def test_a_tool_that_raises_or_hangs_becomes_an_error_or_a_timeout():
    async def broken(_user, _arguments, _key):
        raise RuntimeError("internal detail")

    async def hangs(_user, _arguments, _key):
        await asyncio.Event().wait()
        return ""

    config = ToolConfig(
        enabled=True, timeout_s=0.05, allowed={"free": "broken,hangs", "pro": "", "enterprise": ""}
    )
    box = _toolbox(
        config, {"broken": Tool(Function("broken"), broken), "hangs": Tool(Function("hangs"), hangs)}
    )
    failed = await box.run("u1", "free", _call("broken"))
    assert (failed.outcome, failed.text) == ("error", "The tool failed.")  # no internal detail
    timed_out = await box.run("u1", "free", _call("hangs"))
    assert timed_out.outcome == "timeout"


async def test_a_long_result_is_cut_and_says_so():
    async def chatty(_user, _arguments, _key):
        return "x" * 10_000

    config = ToolConfig(
        enabled=True, max_result_chars=100, allowed={"free": "chatty", "pro": "", "enterprise": ""}
    )
    result = await _toolbox(config, {"chatty": Tool(Function("chatty"), chatty)}).run(
        "u", "free", _call("chatty")
    )
    assert len(result.text) <= 100 and result.text.endswith("characters]")


def test_an_interrupted_step_is_a_result_not_a_rerun():
    before = _counted("calculator", "interrupted")
    result = _toolbox().interrupted(_call("calculator", expression="1"))
    assert result.outcome == "interrupted" and "not run again" in result.text
    assert _counted("calculator", "interrupted") == before + 1


async def test_the_chat_search_finds_the_callers_chats_only(memory_store):
    """The retrieval SearchChats uses, in the session's Cassandra, bound to the caller."""
    owner, other = new_user(), new_user()
    chat = await memory_store.create_chat(owner, "Garden plans")
    await memory_store.append_message(owner, message(chat.chat_id, "plant tulips by the fence in march"))
    search = ChatSearch(memory_store)
    found = await search(owner, {"query": "tulips fence"})
    assert "Garden plans" in found and "tulips" in found and found.count("\n") == 0
    assert await search(other, {"query": "tulips"}) == "No chat mentions 'tulips'."
    with pytest.raises(ValueError, match="non-empty"):
        await search(owner, {"query": " "})
    with pytest.raises(ValueError, match="at least one word"):
        await search(owner, {"query": "!!!"})
