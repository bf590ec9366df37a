"""Chat users for the chaos suite: each sends messages in a stored chat through the front door, as the chat
page does, and records what it saw of every answer.

One answer (``ChatUser.answer``): POST /v1/chats/{id}/messages with an idempotency key, read the SSE
stream; a refusal that says "later" (429, 502, 503, 504, a refused connection) is retried with the same
key after a backoff of at least Retry-After; a stream that breaks is resumed with GET
/v1/runs/{id}/events and ``Last-Event-ID`` (the page's ``follow``), backing off between tries. An
``error`` event with a sequence number is the run's own end (final, as on the page); one without is the
edge saying its upstream broke, and the client resumes (the page still takes it as the end there).

Every answer becomes an ``Answer``: the text as the page would show it (every delta appended, in the
order it came), every sequence number got and how often, how it ended and when, and the retries it took.
The page's streams merge the deltas waiting when they are behind into one, numbered as the last: a delta
stands for the sequence numbers since the event before it in its stream (or since its Last-Event-ID).
Tool step events (``step_started``, ``step_result``) are kept as they came, to compare with what the
run stored (``run_steps``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from functools import partial

import httpx

from chatmesh.identity import CHAT_ID_HEADER

# Statuses and failures after which the same request is tried again later.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 4.0


@dataclass(frozen=True)
class StepEvent:
    """A tool step event of a run's stream (docs/tools.md)."""

    seq: int
    kind: str  # step_started or step_result
    call_id: str
    outcome: str = ""  # a result's: ok, error, timeout, refused, interrupted


@dataclass
class Answer:
    """One answer as one user saw it."""

    user: str
    chat_id: str
    sent_at: float
    run_id: str = ""
    user_message_id: str = ""
    text: str = ""
    seqs: Counter[int] = field(default_factory=Counter)
    # "done", "error" (the run's own error event, or a refusal that is final), or "" while open.
    outcome: str = ""
    error: str = ""
    ended_at: float = 0.0
    # Requests tried again (a refusal that says "later") and streams resumed after a break.
    retries: int = 0
    resumes: int = 0
    # The tool step events got, in order, with repeats.
    steps: list[StepEvent] = field(default_factory=list)
    # Whether the question was one of the load's tool share (tool_load.py).
    tools: bool = False

    @property
    def completed(self) -> bool:
        return self.outcome == "done"

    @property
    def last_seq(self) -> int:
        return max(self.seqs, default=0)

    @property
    def gaps(self) -> int:
        """Sequence numbers between 1 and the last one seen that never arrived."""
        return sum(1 for seq in range(1, self.last_seq + 1) if seq not in self.seqs)

    @property
    def duplicates(self) -> int:
        """Events that arrived more than once (each extra arrival counts)."""
        return sum(count - 1 for count in self.seqs.values())

    def got(self, name: str, seq: int, after: int) -> None:
        """Counts the sequence numbers an event stands for: a delta, those after ``after`` (the event
        before it in its stream, or the stream's Last-Event-ID); any other event (or a delta numbered at
        or before ``after``: a repeat), its own."""
        first = after + 1 if name == "delta" and seq > after else seq
        for covered in range(first, seq + 1):
            self.seqs[covered] += 1


@dataclass(frozen=True)
class SseEvent:
    name: str
    data: dict
    seq: int | None


async def sse_events(reply: httpx.Response) -> AsyncIterator[SseEvent]:
    name, data, event_id = "message", "", None
    async for line in reply.aiter_lines():
        if line == "":
            if data:
                yield SseEvent(name, json.loads(data), int(event_id) if event_id else None)
            name, data, event_id = "message", "", None
        elif not line.startswith(":"):
            key, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if key == "event":
                name = value
            elif key == "data":
                data += value
            elif key == "id":
                event_id = value


class GiveUpError(Exception):
    """The answer could not be had before its deadline."""


class ChatUser:
    """One user of the door, chatting in one chat at a time."""

    def __init__(
        self, http: httpx.AsyncClient, user: str, token: str, max_tokens: int, answer_deadline_s: float
    ) -> None:
        self.http = http
        self.user = user
        self.auth = {"Authorization": f"Bearer {token}"}
        self.max_tokens = max_tokens
        self.answer_deadline_s = answer_deadline_s

    async def create_chat(self) -> str:
        reply = await self._with_retries(lambda: self.http.post("/v1/chats", json={}, headers=self.auth))
        return str(reply.json()["chat_id"])

    async def messages(self, chat_id: str) -> list[dict]:
        """Every stored message of the chat (all pages)."""
        found: list[dict] = []
        token = ""
        while True:
            params = {"page_size": "100", **({"page_token": token} if token else {})}
            reply = await self._with_retries(
                partial(self.http.get, f"/v1/chats/{chat_id}/messages", params=params, headers=self.auth)
            )
            body = reply.json()
            found += body["messages"]
            if not (token := body.get("next_page_token") or ""):
                return found

    async def _with_retries(self, request: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        deadline = time.monotonic() + self.answer_deadline_s
        for attempt in range(1, 1000):
            try:
                reply = await request()
            except httpx.TransportError:
                reply = None
            if reply is not None and reply.status_code not in RETRY_STATUSES:
                reply.raise_for_status()
                return reply
            if time.monotonic() > deadline:
                raise GiveUpError(f"no answer within {self.answer_deadline_s:.0f}s")
            await asyncio.sleep(backoff_s(attempt, reply))
        raise AssertionError("unreachable")

    async def run_steps(self, run_id: str, chat_id: str) -> list[StepEvent]:
        """The tool step events a run stored, replayed from its start."""
        events = Answer(self.user, chat_id, time.monotonic(), run_id=run_id)
        headers = {**self.auth, CHAT_ID_HEADER: chat_id}
        deadline = time.monotonic() + self.answer_deadline_s
        attempt = 0
        while not events.outcome and time.monotonic() < deadline:
            attempt += 1
            events.steps.clear()
            request = self.http.stream("GET", f"/v1/runs/{run_id}/events", headers=headers)
            refused = await self._read(request, events, resuming=True)
            if not events.outcome:
                await asyncio.sleep(backoff_s(attempt, refused))
        if not events.outcome:
            raise GiveUpError(f"run {run_id}'s events could not be read")
        return events.steps

    async def answer(self, chat_id: str, content: str, tools: bool = False, max_tokens: int = 0) -> Answer:
        """``tools``: the question is one of the tool share (its answer calls tools); ``max_tokens``:
        the answer's, if not the user's."""
        record = Answer(self.user, chat_id, time.monotonic(), tools=tools)
        deadline = record.sent_at + self.answer_deadline_s
        body = {
            "content": content,
            "idempotency_key": uuid.uuid4().hex,
            "options": {"max_tokens": max_tokens or self.max_tokens, "temperature": 0},
        }
        attempt = 0
        try:
            while not record.outcome:
                if time.monotonic() > deadline:
                    raise GiveUpError(f"no end within {self.answer_deadline_s:.0f}s")
                attempt += 1
                if record.run_id:
                    record.resumes += 1
                    request = self.http.stream(
                        "GET",
                        f"/v1/runs/{record.run_id}/events",
                        headers={
                            **self.auth,
                            "Last-Event-ID": str(record.last_seq),
                            CHAT_ID_HEADER: chat_id,
                        },
                    )
                else:  # nothing of the run seen yet: the same send again (the key makes it one run)
                    record.retries += attempt > 1
                    request = self.http.stream(
                        "POST", f"/v1/chats/{chat_id}/messages", json=body, headers=self.auth
                    )
                refused = await self._read(request, record, resuming=bool(record.run_id))
                if not record.outcome:
                    await asyncio.sleep(backoff_s(attempt, refused))
        except GiveUpError as exc:
            record.outcome, record.error = "error", str(exc)
        record.ended_at = time.monotonic()
        return record

    async def _read(
        self, request: AbstractAsyncContextManager[httpx.Response], record: Answer, resuming: bool
    ) -> httpx.Response | None:
        """Reads one response into ``record``; returns it when it was a refusal to try again later."""
        try:
            async with request as reply:
                if reply.status_code in RETRY_STATUSES:
                    await reply.aread()
                    return reply
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")
                    record.outcome, record.error = "error", f"HTTP {reply.status_code}: {text[:200]}"
                    return None
                events, after = 0, record.last_seq  # a new send's stream starts at 0, a resumed one after it
                async for event in sse_events(reply):
                    events += 1
                    if event.seq is not None:
                        record.got(event.name, event.seq, after)
                        after = event.seq
                    if self._take(event, record):
                        return None
                if resuming and not events:
                    # The run had ended at our Last-Event-ID: its final event is not to be had.
                    record.outcome, record.error = "error", "the run ended without an end we saw"
        except httpx.TransportError:
            pass  # a broken stream or a refused connection: resume (or send again)
        return None

    @staticmethod
    def _take(event: SseEvent, record: Answer) -> bool:
        """Applies one event as the page does; True when it ended the answer or the stream broke."""
        if event.name == "started":
            record.run_id = event.data["run_id"]
            record.user_message_id = event.data.get("user_message_id") or ""
        elif event.name == "delta":
            record.text += event.data["text"]
        elif event.name in ("step_started", "step_result") and event.seq is not None:
            data = event.data
            record.steps.append(StepEvent(event.seq, event.name, data["call_id"], data.get("outcome", "")))
        elif event.name == "done":
            record.outcome = "done"
            return True
        elif event.name == "error":
            if event.seq is not None:  # the run's own end
                record.outcome = "error"
                record.error = f"{event.data.get('code')}: {event.data.get('message')}"
            return True  # without a seq: the edge lost its upstream mid-stream; resume
        return False


def backoff_s(attempt: int, reply: httpx.Response | None) -> float:
    """The page's backoff (doubling from 0.25 s, at most 4 s), never less than Retry-After."""
    retry_after = 0.0
    if reply is not None:
        try:
            retry_after = float(reply.headers.get("retry-after", "0"))
        except ValueError:
            retry_after = 0.0
    return max(retry_after, min(FIRST_BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S))
