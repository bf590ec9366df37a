"""Tools (function calling) in OpenAI's shapes, for models whose chat template has no tool format.

The format (docs/structured-outputs.md, "Tools"): the tools are described in the system turn, and a
call is ``<tool_call>{"name": "<function>", "arguments": {...}}</tool_call>``, one per call, one call
per line: Hermes' and Qwen's tags, which ChatML models such as SmolLM2 have seen most. The answer is
constrained by a grammar (engine.structured's Lark grammars, JSON schemas embedded):

- ``auto``: text (not starting with ``<``), or one or more calls, each call's arguments constrained to
  its function's ``parameters`` schema;
- ``required``: one or more calls; a named function: exactly one call to it;
- ``none``: no tools described, no constraint.

``parallel_tool_calls: false`` allows one call. The answer's text is parsed back into ``tool_calls``
(``ToolCallParser``, also while streaming); history in OpenAI's shapes (assistant ``tool_calls``,
``role: tool`` results) is rendered back into the same format, a result as a user turn holding
``<tool_response>...</tool_response>`` (plain text: a result can never produce a control token).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import model_validator

from chatmesh.chat.v1 import chat_pb2
from edge.strict import Strict
from edge.structured_outputs import FunctionName

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
# How the grammar writes the JSON inside a call (as engine.structured writes any JSON).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


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


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI gives it

    def chat_json(self, index: int | None = None) -> dict:
        call: dict[str, Any] = {"id": self.id, "type": "function"}
        call["function"] = {"name": self.name, "arguments": self.arguments}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class Tools:
    """A request's tools and how they may be used, resolved (``tools_for``)."""

    functions: tuple[FunctionIn, ...]
    choice: str  # "auto" | "required" | a function's name
    parallel: bool

    def system_text(self) -> str:
        """What the system turn says of the tools (the model's only way to know them)."""
        described = "\n".join(
            json.dumps(
                {
                    "name": f.name,
                    "description": f.description or "",
                    "parameters": f.parameters or _NO_PARAMETERS,
                }
            )
            for f in self.functions
        )
        how = "Call one function" if not self.parallel else "Call one or more functions, one per line"
        ask = {"auto": "You may call functions when they help.", "required": "You must call a function."}.get(
            self.choice, f"You must call the function {self.choice}."
        )
        return (
            f"# Tools\n\n{ask} The functions:\n<tools>\n{described}\n</tools>\n\n{how} by answering "
            f'{CALL_OPEN}{{"name": <function name>, "arguments": <arguments as a JSON object>}}{CALL_CLOSE}'
            + (" or answer in plain text." if self.choice == "auto" else ".")
        )

    def constraint(self) -> chat_pb2.StructuredOutput:
        """The grammar the answer must follow (see the module's doc)."""
        chosen = [f for f in self.functions if self.choice in ("auto", "required") or f.name == self.choice]
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": f.parameters or _NO_PARAMETERS},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in chosen
            ],
            "x-guidance": _COMPACT,
        }
        calls = 'call ("\\n" call)*' if self.parallel and self.choice in ("auto", "required") else "call"
        rules = [
            f"start: {'TEXT | calls' if self.choice == 'auto' else 'calls'}",
            f"calls: {calls}",
            f"call: {json.dumps(CALL_OPEN)} %json {json.dumps(call)} {json.dumps(CALL_CLOSE)}",
            r"TEXT: /[^<][\s\S]*/",
        ]
        return chat_pb2.StructuredOutput(grammar="\n".join(rules))


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
    return Tools(tuple(functions), resolved, parallel is not False)


def call_id(seed: str, index: int) -> str:
    """A tool call's id: a function of the answer's id and the call's place in it, so an answer read
    again (a stored response) names its calls the same."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


@dataclass
class ToolCallParser:
    """Splits an answer, as it streams, into text and tool calls. Text that could still become a call
    (a prefix of ``<tool_call>``) is held back until it is known."""

    seed: str  # the answer's id (call ids derive from it)
    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""
    _mode: str = ""  # "" undecided, "text", "calls"

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text to release now and the calls completed by ``text``."""
        self._held += text
        if not self._mode:
            if self._held.startswith(CALL_OPEN):
                self._mode = "calls"
            elif not CALL_OPEN.startswith(self._held):
                self._mode = "text"
            else:
                return "", []
        if self._mode == "text":
            released, self._held = self._held, ""
            return released, []
        completed: list[ToolCall] = []
        while (end := self._held.find(CALL_CLOSE)) >= 0:
            block = self._held[: end + len(CALL_CLOSE)]
            self._held = self._held[len(block) :]
            try:
                call = json.loads(block.lstrip("\n").removeprefix(CALL_OPEN).removesuffix(CALL_CLOSE))
                name, arguments = call["name"], json.dumps(call["arguments"])
            except (ValueError, KeyError, TypeError):  # never under the grammar: text written unconstrained
                self._mode, released, self._held = "text", block + self._held, ""
                return released, completed
            completed.append(ToolCall(call_id(self.seed, len(self.calls)), name, arguments))
            self.calls.append(completed[-1])
        self._held = self._held.lstrip("\n")  # between calls (it may come in a later piece)
        return "", completed

    def rest(self) -> str:
        """What is left at the end: held text, or a call the answer did not finish (cut by max_tokens)."""
        rest, self._held = self._held, ""
        return rest


def parse_answer(text: str, seed: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer as (text or None, calls)."""
    parser = ToolCallParser(seed)
    released, calls = parser.feed(text)
    released += parser.rest()
    return (released or None) if calls else released, calls


def calls_text(calls: list[ToolCallIn]) -> str:
    """An assistant's tool calls in the model's format (history given back by the client)."""
    lines = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = call.function.arguments
        lines.append(
            f"{CALL_OPEN}{json.dumps({'name': call.function.name, 'arguments': arguments})}{CALL_CLOSE}"
        )
    return "\n".join(lines)


def result_text(content: str) -> str:
    """A tool's result, as the user turn that brings it to the model."""
    return f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"


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
