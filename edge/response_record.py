"""A Responses API ``response`` object, folded from the events of the run behind it.

A response is a run: its id is ``resp_`` + the run id (hex), its output message ``msg_`` + the
assistant message id (or the run id for an unstored response). An answer made of tool calls (edge.tools'
format, which only a request with tools is constrained to) is output as ``function_call`` items instead.
Everything the object says comes from the run's events (``started``, ``delta``s, ``usage``, ``done`` or ``error``), so the same object is
rebuilt on any replica, at any time, from the events the orchestrator replays out of Cassandra.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tool_format import ToolCall, parse_answer
from edge.errors import ApiError

RESPONSE_PREFIX = "resp_"
MESSAGE_PREFIX = "msg_"

# How a run that ended without error ended, as the response's status and incomplete_details.reason.
_ENDINGS: dict[int, tuple[str, str | None]] = {
    chat_pb2.FINISH_REASON_STOP: ("completed", None),
    chat_pb2.FINISH_REASON_LENGTH: ("incomplete", "max_output_tokens"),
    chat_pb2.FINISH_REASON_CONTENT_FILTER: ("incomplete", "content_filter"),
    chat_pb2.FINISH_REASON_CANCELLED: ("cancelled", None),
    chat_pb2.FINISH_REASON_ERROR: ("failed", None),
}
# OpenAI's response error codes are few; a run's gRPC code maps onto the nearest.
_ERROR_CODES = {"RESOURCE_EXHAUSTED": "rate_limit_exceeded", "INVALID_ARGUMENT": "invalid_prompt"}


def response_id(run_id: str) -> str:
    return RESPONSE_PREFIX + uuid.UUID(run_id).hex


def run_id_of(value: str, param: str | None) -> str:
    """The run id a response id names; 404 (naming ``param``) for anything that is not one of ours."""
    try:
        run_id = uuid.UUID(hex=value.removeprefix(RESPONSE_PREFIX))
        # Run ids are time-based (version 1) UUIDs.
        if not value.startswith(RESPONSE_PREFIX) or run_id.version != 1:
            raise ValueError(value)
        return str(run_id)
    except ValueError:
        raise response_not_found(value, param) from None


def response_not_found(value: str, param: str | None = None) -> ApiError:
    return ApiError(
        404, f"response {value!r} not found", type="invalid_request_error", code="not_found", param=param
    )


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: ToolCall, status: str, arguments: str | None = None) -> dict:
    """A ``function_call`` output item (``arguments``: as far as they are streamed; None: all)."""
    return {
        "id": "fc_" + call.id.removeprefix("call_"),
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": status,
    }


def usage_json(usage: chat_pb2.Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass
class ResponseRecord:
    """What is known of a response: the request's echoed settings, then what its run's events said."""

    created_at: float = field(default_factory=time.time)
    model: str = ""
    store: bool = True
    background: bool | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text_format: dict | None = None
    tools: list[dict] = field(default_factory=list)
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    # From the run's events.
    run_id: str = ""
    message_id: str = ""
    text: list[str] = field(default_factory=list)
    usage: chat_pb2.Usage | None = None
    status: str = "in_progress"
    incomplete_reason: str | None = None
    error: dict | None = None

    @property
    def id(self) -> str:
        return response_id(self.run_id)

    @property
    def ended(self) -> bool:
        return self.status != "in_progress"

    def apply(self, event: chat_pb2.RunEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "started":
            started = event.started
            self.run_id = started.run_id
            self.model = started.model or self.model
            self.message_id = MESSAGE_PREFIX + uuid.UUID(started.assistant_message_id or started.run_id).hex
        elif kind == "delta":
            self.text.append(event.delta.text)
        elif kind == "usage":
            self.usage = event.usage
        elif kind == "done":
            self.status, self.incomplete_reason = _ENDINGS.get(event.done.finish_reason, ("completed", None))
        elif kind == "error":
            error = event.error
            self.fail(error.code, error.message)

    def fail(self, code: str, message: str) -> None:
        self.status = "failed"
        self.error = {"code": _ERROR_CODES.get(code.upper(), "server_error"), "message": message}

    def output_text(self) -> str:
        return "".join(self.text)

    def message_item(self, text: str | None = None) -> dict:
        """The output message (``text``: its one text part; None: no part yet)."""
        status = (
            "in_progress" if not self.ended else "completed" if self.status == "completed" else "incomplete"
        )
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [] if text is None else [text_part(text)],
        }

    def output(self) -> list[dict]:
        """The output items: the message, or the calls its text makes (ids derived from the run's)."""
        if not self.ended:
            return [self.message_item(self.output_text())]
        content, calls = parse_answer(self.output_text(), self.run_id)
        if not calls:
            return [self.message_item(self.output_text())]
        status = "completed" if self.status == "completed" else "incomplete"
        items = [function_call_item(call, status) for call in calls]
        if content:  # a call the answer did not finish (cut by max_output_tokens)
            items.append(self.message_item(content))
        return items

    def json(self, with_output: bool = True) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": self.background,
            "error": self.error,
            "incomplete_details": {"reason": self.incomplete_reason} if self.incomplete_reason else None,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": {},
            "model": self.model,
            "output": self.output() if with_output and self.message_id else [],
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "temperature": self.temperature,
            "text": {"format": self.text_format or {"type": "text"}},
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage_json(self.usage) if self.usage is not None else None,
        }
