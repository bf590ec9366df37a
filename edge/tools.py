"""Tools (function calling) in OpenAI's shapes: the request's tools, ``tool_choice`` and history given
back, resolved into chatmesh.tool_format's ``Tools`` (the model's format, shared with the tools the
orchestrator runs itself)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from chatmesh import tool_format
from chatmesh.chat.v1 import chat_pb2
from chatmesh.tool_format import Function, Tools
from edge.strict import Strict
from edge.structured_outputs import FunctionName


class FunctionIn(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # strict or not, the arguments are constrained to ``parameters``


class ToolIn(Strict):
    """A Chat Completions tool."""

    type: Literal["function"]
    function: FunctionIn


class ResponseToolIn(FunctionIn):
    """A Responses API tool (the function's fields beside ``type``)."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _a_function(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise ValueError(f"tools of type {data.get('type')!r} are not served here: only function tools")
        return data


class ChosenFunctionIn(Strict):
    name: FunctionName


class NamedToolChoiceIn(Strict):
    """``tool_choice`` naming a function: Chat Completions' shape or the Responses API's."""

    type: Literal["function"]
    function: ChosenFunctionIn | None = None
    name: FunctionName | None = None

    def chosen(self) -> str:
        chosen = self.function.name if self.function is not None else self.name
        if chosen is None:
            raise ValueError("tool_choice names no function")
        return chosen


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoiceIn


class CalledFunctionIn(Strict):
    name: str
    arguments: str


class ToolCallIn(Strict):
    """An assistant message's tool call given back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunctionIn


def tools_for(functions: list[FunctionIn], choice: ToolChoice | None, parallel: bool | None) -> Tools | None:
    """The request's tools as they apply to its answer; None when none may be called. Raises ValueError
    for a ``tool_choice`` that names a function not among them, or tool settings without tools ("none"
    and "auto" ask for nothing without tools, and clients send them so: they are answered in text)."""
    if not functions and (choice not in (None, "none", "auto") or parallel is not None):
        raise ValueError(
            "a tool_choice other than 'none' or 'auto', and parallel_tool_calls, are only allowed when tools are given"
        )
    if not functions or choice == "none":
        return None
    resolved = "auto" if choice is None else choice if isinstance(choice, str) else choice.chosen()
    if resolved not in ("auto", "required") and resolved not in {f.name for f in functions}:
        raise ValueError(f"tool_choice names {resolved!r}, which is not among the tools")
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("two tools have the same name")
    described = tuple(Function(f.name, f.description, f.parameters) for f in functions)
    return Tools(described, resolved, parallel is not False)


def calls_text(calls: list[ToolCallIn]) -> str:
    """An assistant's tool calls in the model's format (history given back by the client)."""
    return tool_format.calls_text([(call.function.name, call.function.arguments) for call in calls])


def with_tools_described(
    messages: list[chat_pb2.PromptMessage], tools: Tools
) -> list[chat_pb2.PromptMessage]:
    """``messages`` with the tools described at the end of the system turn (a new one if none leads)."""
    described = tools.system_text()
    if messages and messages[0].role == chat_pb2.ROLE_SYSTEM:
        first = chat_pb2.PromptMessage(
            role=chat_pb2.ROLE_SYSTEM, content=f"{messages[0].content}\n\n{described}"
        )
        return [first, *messages[1:]]
    return [chat_pb2.PromptMessage(role=chat_pb2.ROLE_SYSTEM, content=described), *messages]
