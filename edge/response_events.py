"""A run's events as the Responses API's stream events, numbered by ``sequence_number``.

The numbering is a pure function of the run's events, which the orchestrator replays with the same
sequence numbers on any replica: so a client that saw event N and lost the stream resumes with
``GET /v1/responses/{id}?stream=true&starting_after=N`` and gets every later event exactly once, even
from another replica and after the replica that generated the response is gone.

    started  -> response.created, response.in_progress, response.output_item.added,
                response.content_part.added
    delta    -> response.output_text.delta
    usage    -> (nothing: it is part of the final response object)
    done     -> response.output_text.done, response.content_part.done, response.output_item.done,
                response.completed | response.incomplete (also for a cancelled one: OpenAI's stream
                events have no "cancelled"; the response's status says it)
    error    -> the same three, then response.failed
"""

from __future__ import annotations

from sse_starlette import ServerSentEvent

from chatmesh.chat.v1 import chat_pb2
from edge.errors import ApiError
from edge.response_record import ResponseRecord
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

    def sse(self, event: chat_pb2.RunEvent) -> list[ServerSentEvent]:
        return [_sse(body) for body in self.events(event) if body["sequence_number"] > self.starting_after]

    def events(self, event: chat_pb2.RunEvent) -> list[dict]:
        record = self.record
        record.apply(event)
        kind = event.WhichOneof("kind")
        if kind == "started":
            return [
                self._event("response.created", response=record.json(with_output=False)),
                self._event("response.in_progress", response=record.json(with_output=False)),
                self._event("response.output_item.added", output_index=0, item=record.message_item(False)),
                self._event(
                    "response.content_part.added",
                    item_id=record.message_id,
                    output_index=0,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                ),
            ]
        if kind == "delta":
            return [
                self._event(
                    "response.output_text.delta",
                    item_id=record.message_id,
                    output_index=0,
                    content_index=0,
                    delta=event.delta.text,
                    logprobs=[],
                )
            ]
        if kind in ("done", "error"):
            return self._end()
        return []

    def _end(self) -> list[dict]:
        record = self.record
        where = {"item_id": record.message_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=record.output_text(), logprobs=[]),
            self._event("response.content_part.done", **where, part=record.text_part()),
            self._event("response.output_item.done", output_index=0, item=record.message_item()),
            self._event(_TERMINAL_EVENTS[record.status], response=record.json()),
        ]

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
