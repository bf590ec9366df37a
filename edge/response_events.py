"""A run's events as the Responses API's stream events, numbered by ``sequence_number``.

The numbering is a pure function of the run's events, which the orchestrator replays with the same
sequence numbers on any replica: so a client that saw event N and lost the stream resumes with
``GET /v1/responses/{id}?stream=true&starting_after=N`` and gets every later event exactly once, even
from another replica and after the replica that generated the response is gone.

    started  -> response.created, response.in_progress
    delta    -> its text, split as chatmesh.tool_format's parser splits an answer (text that could
                still be a tool call waits until it is known):
                text: (response.output_item.added, response.content_part.added: the message's, the
                      first time) response.output_text.delta
                call: response.output_item.added (a function_call with no arguments yet),
                      response.function_call_arguments.delta (all of them: a call is known once its
                      whole text is), response.function_call_arguments.done, response.output_item.done
    usage    -> (nothing: it is part of the final response object)
    done     -> the message's response.output_text.done, response.content_part.done,
                response.output_item.done (an answer with no call and no text still has its message),
                then response.completed | response.incomplete (also for a cancelled one: OpenAI's
                stream events have no "cancelled"; the response's status says it)
    error    -> the same, then response.failed

The items come in the order ``ResponseRecord.output`` lists them: the calls, then the message.
"""

from __future__ import annotations

from sse_starlette import ServerSentEvent

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tool_format import ToolCall, ToolCallParser
from edge.errors import ApiError
from edge.response_record import ResponseRecord, function_call_item, text_part
from edge.sse import compact_json

_TERMINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


class ResponseEvents:
    """Folds run events into ``record`` and writes the stream events after ``starting_after``."""

    def __init__(self, record: ResponseRecord, starting_after: int = -1) -> None:
        self.record = record
        self.starting_after = starting_after
        self.next_number = 0
        self._parser = ToolCallParser("")
        self._items = 0  # output items added so far
        self._message_index: int | None = None  # the message's output index, once added
        self._text: list[str] = []  # the message's text so far

    def sse(self, event: chat_pb2.RunEvent) -> list[ServerSentEvent]:
        return [_sse(body) for body in self.events(event) if body["sequence_number"] > self.starting_after]

    def events(self, event: chat_pb2.RunEvent) -> list[dict]:
        record = self.record
        record.apply(event)
        kind = event.WhichOneof("kind")
        if kind == "started":
            self._parser = ToolCallParser(record.run_id)  # call ids derive from the run's, as in output()
            return [
                self._event("response.created", response=record.json(with_output=False)),
                self._event("response.in_progress", response=record.json(with_output=False)),
            ]
        if kind == "delta":
            text, calls = self._parser.feed(event.delta.text)
            return [body for call in calls for body in self._call(call)] + self._message_text(text)
        if kind in ("done", "error"):
            return self._end()
        return []

    def _call(self, call: ToolCall) -> list[dict]:
        index, self._items = self._items, self._items + 1
        item_id = function_call_item(call, "")["id"]
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(call, "in_progress", arguments=""),
            ),
            self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=index,
                delta=call.arguments,
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                arguments=call.arguments,
            ),
            self._event(
                "response.output_item.done", output_index=index, item=function_call_item(call, "completed")
            ),
        ]

    def _message_text(self, text: str) -> list[dict]:
        """The message's next text: added first, unless it was."""
        if not text:
            return []
        self._text.append(text)
        return [
            *self._add_message(),
            self._event(
                "response.output_text.delta",
                item_id=self.record.message_id,
                output_index=self._message_index,
                content_index=0,
                delta=text,
                logprobs=[],
            ),
        ]

    def _add_message(self) -> list[dict]:
        if self._message_index is not None:
            return []
        self._message_index, self._items = self._items, self._items + 1
        return [
            self._event(
                "response.output_item.added",
                output_index=self._message_index,
                item=self.record.message_item(),
            ),
            self._event(
                "response.content_part.added",
                item_id=self.record.message_id,
                output_index=self._message_index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def _end(self) -> list[dict]:
        record = self.record
        out = self._message_text(self._parser.rest())
        if self._items == 0:
            out += self._add_message()
        if self._message_index is not None:
            text = "".join(self._text)
            where = {"item_id": record.message_id, "output_index": self._message_index, "content_index": 0}
            out += [
                self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=text_part(text)),
                self._event(
                    "response.output_item.done",
                    output_index=self._message_index,
                    item=record.message_item(text),
                ),
            ]
        return [*out, self._event(_TERMINAL_EVENTS[record.status], response=record.json())]

    def error(self, error: ApiError) -> list[ServerSentEvent]:
        """A failure of the stream itself, not of the run (which may go on). It carries the number of the
        last event sent, so resuming after it misses nothing."""
        body = {"type": "error", "code": error.code, "message": error.message, "param": None}
        return [_sse({**body, "sequence_number": self.next_number - 1})]

    def drained(self) -> list[ServerSentEvent]:
        return self.error(
            ApiError(
                503,
                "the server is restarting; resume the stream with GET /v1/responses/"
                f"{self.record.id}?stream=true&starting_after={self.next_number - 1}",
                code="draining",
            )
        )

    def _event(self, kind: str, **fields: object) -> dict:
        body = {"type": kind, "sequence_number": self.next_number, **fields}
        self.next_number += 1
        return body


def _sse(body: dict) -> ServerSentEvent:
    return ServerSentEvent(event=body["type"], data=compact_json(body))
