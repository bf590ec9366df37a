"""The model's tool-call format, shared by the edge (the caller's tools on OpenAI routes) and the
orchestrator (the tools it runs itself in stored chats): our models' templates have none, so this one
is ours (docs/structured-outputs.md, "Tools").

The tools are described in the system turn, and a call is
``<tool_call>{"name": "<function>", "arguments": {...}}</tool_call>``, one per call, one call per line:
Hermes' and Qwen's tags, which ChatML models such as SmolLM2 have seen most. The answer is constrained
by a grammar (engine.structured's Lark grammars, JSON schemas embedded):

- ``auto``: text (not starting with ``<``), or one or more calls, each call's arguments constrained to
  its function's ``parameters`` schema;
- ``required``: one or more calls; a named function: exactly one call to it.

``parallel`` false allows one call. The answer's text is parsed back into calls (``ToolCallParser``,
also while streaming); a result goes back to the model as a user turn holding
``<tool_response>...</tool_response>`` as plain text: a result can never produce a control token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chatmesh.chat.v1 import chat_pb2

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
# How the grammar writes the JSON inside a call (as engine.structured writes any JSON).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Function:
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class Tools:
    """An answer's tools and how they may be used."""

    functions: tuple[Function, ...]
    choice: str  # "auto" | "required" | a function's name
    parallel: bool

    def system_text(self) -> str:
        """What the system turn says of the tools (the model's only way to know them)."""
        described = "\n".join(
            json.dumps(
                {
                    "name": f.name,
                    "description": f.description or "",
                    "parameters": f.parameters or NO_PARAMETERS,
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
                    "properties": {"name": {"const": f.name}, "arguments": f.parameters or NO_PARAMETERS},
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
        return chat_pb2.StructuredOutput(grammar="\n".join([*rules, CALLS_MARK]))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI gives it

    def chat_json(self, index: int | None = None) -> dict:
        call: dict[str, Any] = {"id": self.id, "type": "function"}
        call["function"] = {"name": self.name, "arguments": self.arguments}
        return call if index is None else {"index": index, **call}


def call_id(seed: str, index: int) -> str:
    """A tool call's id: a function of the answer's id and the call's place in it, so an answer read
    again (a stored response, a replayed run) names its calls the same."""
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


# The last line of a grammar that makes an answer tool calls the caller runs (a Lark comment): a stored
# answer is read as its calls only under it. The orchestrator's own tools add a mark of their own after
# it (orchestrator/tools/toolbox.py): their calls are steps of the run, and its stored answer is text.
CALLS_MARK = "// chatmesh: tool calls the caller runs"


def caller_runs_calls(grammar: str) -> bool:
    """Whether an answer constrained by ``grammar`` is tool calls for the caller to run (and text)."""
    return grammar.endswith(f"\n{CALLS_MARK}")


def parse_answer(text: str, seed: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer as (text or None, calls)."""
    parser = ToolCallParser(seed)
    released, calls = parser.feed(text)
    released += parser.rest()
    return (released or None) if calls else released, calls


def calls_text(calls: Sequence[tuple[str, str]]) -> str:
    """Tool calls, given as (function name, arguments as JSON text), in the model's format."""
    lines = []
    for name, arguments_json in calls:
        try:
            arguments = json.loads(arguments_json)
        except ValueError:
            arguments = arguments_json
        lines.append(f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}")
    return "\n".join(lines)


def with_calls(text: str, calls: Sequence[tuple[str, str]]) -> str:
    """An answer as the model wrote it: its text, then its calls (``calls_text``), a line apart."""
    return "\n".join(part for part in (text, calls_text(calls)) if part)


def result_text(content: str) -> str:
    """A tool's result, as the user turn that brings it to the model."""
    return f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"
