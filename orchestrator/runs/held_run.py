"""A run this replica holds in memory: where it stands (``run_state.py``), its events in order, and the
streams following them.

Events are numbered from 1 (``started``), then ``delta``s (and tool steps among them, docs/tools.md),
then ``usage`` and ``done`` (or one ``error``). The buffer is append-only and bounded by the run's ``max_tokens``: at most one delta per
token, and one more for the text the engine held back (the start of a stop string, part of a
character) and flushed when the answer ended. A delta past that bound is refused, never the end: room
for it is kept, so followers always get it. Any follower can start from any sequence number. Followers read it at their own pace: the
writer never waits for them, so a slow stream slows neither the run nor the other streams, and a
stream that falls behind simply reads on from where it was.

A delta is kept as its text and token count, and made a RunEvent for each follower as it reads it: a
RunEvent holding a delta takes ~920 bytes of memory (its own protobuf arena and two Python wrappers),
its text and count ~120, and every open stream holds every delta of its answer so far.

A follower that asked to ``merge_deltas`` gets the deltas waiting when it reads as one event, numbered
as the last of them. A follower wakes when the run appends, so one that keeps up gets each delta
alone, when it is made; one that is behind gets one message where it would get several. A stream is
behind when it attaches to a run in progress, replays one, waits on a slow client, or when several
tokens arrive in one router frame (the relay appends them at once). While the replica's loop runs
late, such a follower also lets the deltas after each one it sent gather for the replica's stream
interval (``meshkit.pacing``): a loaded replica sends fewer, fuller events, an idle one each delta as
it is made.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import exhausted, unavailable
from chatmesh.run_events import MAX_MERGED_DELTAS, merged_delta
from meshkit.arrivals import Wakeup
from meshkit.pacing import StreamPacer
from orchestrator.metrics import METRICS
from orchestrator.runs.run_state import RunState, Stop, check_move


class Generating(Protocol):
    """What generates a live run, as the run sees it (``relay.py:Relay``, which imports this module):
    something to stop and to wait for."""

    def stop(self, reason: Stop) -> None: ...

    async def wait(self, timeout_s: float) -> None: ...


# The events of a run that are no delta: started + usage + done, or started + error.
_FRAME_EVENTS = 3
# Those after the last delta, for which a delta always leaves room.
_END_EVENTS = 2
# Deltas that carry no token: the held-back text an engine flushes at the end (of each model turn).
_FLUSHED_DELTAS = 1
# The events of a tool step: started, result.
_STEP_EVENTS = 2


@dataclass(frozen=True)
class RunInfo:
    """What a run is about. Empty ids where a kind has none (Complete stores nothing)."""

    run_id: str
    user_id: str
    tier: str
    kind: str  # "send" | "regenerate" | "complete"
    model: str
    max_tokens: int
    chat_id: str = ""
    user_message_id: str = ""
    assistant_message_id: str = ""
    # The router placed it in a cheaper model's pool (free tier under load); ``model`` is that model.
    degraded: bool = False
    # Tool steps its answer may take (docs/tools.md): each adds two events, and a turn's flushed text.
    max_tool_steps: int = 0

    @property
    def stored(self) -> bool:
        return self.kind != "complete"


class HeldRun:
    """A run this replica holds (``held_runs.py`` indexes it). Its state moves only through ``go_live``,
    ``finish`` and ``hand_over``, each checked by ``run_state.check_move``."""

    def __init__(self, info: RunInfo, max_subscribers: int, pacer: StreamPacer) -> None:
        self.info = info
        self.pacer = pacer
        steps = info.max_tool_steps * (_STEP_EVENTS + _FLUSHED_DELTAS)
        self.max_events = info.max_tokens + _FLUSHED_DELTAS + _FRAME_EVENTS + steps
        self.max_subscribers = max_subscribers
        # The events in order: a delta as (text, token count), any other kind as its RunEvent.
        self._events: list[chat_pb2.RunEvent | tuple[str, int]] = []
        self._state = RunState.STARTING
        # What GetRun and CancelRun answer: in progress, cancelling, then the end's.
        self.status: chat_pb2.RunStatus = chat_pb2.RUN_STATUS_IN_PROGRESS
        self.created_at = time.time()
        # When it ended (monotonic), for how long it is kept after (``HeldRuns.sweep``).
        self.ended_at: float | None = None
        self.subscribers = 0
        # The relay generating it, from when it goes live.
        self.relay: Generating | None = None
        # A stop asked for while it was starting (an adopted run being placed again): applied as it goes live.
        self._stop_when_live: Stop | None = None
        self._changed = Wakeup()
        self._ended = Wakeup()  # the run finished or was handed over: nothing more gathers
        # How far apart its last two deltas came: one that comes slower than the stream interval has
        # nothing to gather with, and its followers do not wait for a tick.
        self._last_delta_at = -math.inf
        self._delta_gap_s = math.inf

    @property
    def state(self) -> RunState:
        return self._state

    @property
    def last_seq(self) -> int:
        return len(self._events)

    def append(self, **kind: Any) -> chat_pb2.RunEvent:
        """Adds the next event other than a delta (``started=...``, ``usage=...``, ``done=...``,
        ``error=...``) and wakes every follower."""
        if "delta" in kind:
            raise TypeError("deltas are added with append_delta")
        event = chat_pb2.RunEvent(seq=self._next_seq(), **kind)
        self._events.append(event)
        self._changed.notify()
        return event

    def append_delta(
        self, text: str, token_count: int, logprobs: Sequence[chat_pb2.TokenLogprob] = ()
    ) -> int:
        """Adds the next delta and wakes every follower; returns its sequence number. One with
        ``logprobs`` is kept as its event (and is never merged with others: the rare caller that asks for
        them pays the event's memory)."""
        seq = self._next_seq()
        if seq > self.max_events - _END_EVENTS:
            raise RuntimeError(
                f"run {self.info.run_id} exceeded its {self.max_events - _FRAME_EVENTS} deltas"
            )
        if logprobs:
            delta = chat_pb2.Delta(text=text, token_count=token_count, logprobs=logprobs)
            self._events.append(chat_pb2.RunEvent(seq=seq, delta=delta))
        else:
            self._events.append((text, token_count))
        now = time.monotonic()
        self._delta_gap_s, self._last_delta_at = now - self._last_delta_at, now
        self._changed.notify()
        return seq

    def _next_seq(self) -> int:
        if self.state.done_here:
            raise RuntimeError(f"run {self.info.run_id} is {self.state}; no event may follow")
        if len(self._events) >= self.max_events:
            raise RuntimeError(f"run {self.info.run_id} exceeded its {self.max_events} events")
        return len(self._events) + 1

    def event(self, seq: int) -> chat_pb2.RunEvent:
        kept = self._events[seq - 1]
        if isinstance(kept, tuple):
            return merged_delta(seq, (kept,))
        return kept

    def _merged_after(self, position: int) -> chat_pb2.RunEvent:
        """The event after ``position``; if it is a delta, with the deltas right after it (at most
        ``MAX_MERGED_DELTAS`` in all) merged into it."""
        events, last = self._events, position + 1
        if last == len(events) or not isinstance(events[position], tuple):  # one waiting (keeping up)
            return self.event(last)
        limit = min(len(events), position + MAX_MERGED_DELTAS)
        while last < limit and isinstance(events[last], tuple):
            last += 1
        return merged_delta(last, cast(list[tuple[str, int]], events[position:last]))

    def deltas(self) -> Iterator[tuple[int, str, int]]:
        """(seq, text, token count) of every delta so far."""
        for seq, kept in enumerate(self._events, 1):
            if isinstance(kept, tuple):
                yield seq, *kept
            elif kept.HasField("delta"):
                yield seq, kept.delta.text, kept.delta.token_count

    # -- its state ------------------------------------------------------------------------------

    def go_live(self, relay: Generating) -> None:
        """``relay`` generates the run from now on; a stop asked for while it was starting applies now."""
        self._state = check_move(self.info.run_id, self._state, RunState.LIVE)
        self.relay = relay
        if self._stop_when_live is not None:
            relay.stop(self._stop_when_live)  # its end is stored as any stopped run's

    def stop(self, reason: Stop) -> None:
        """Stops the run: at once if it is live, as it goes live if it is starting; one done here stays
        as it is."""
        if self.relay is not None:
            self.relay.stop(reason)  # a no-op once the run is done here
        elif not self.state.done_here:
            self._stop_when_live = reason
            if reason is Stop.CANCELLED:
                self.cancelling()

    def cancelling(self) -> None:
        """CancelRun stopped the run: no output follows, and until its end is stored it reads as
        CANCELLING."""
        if not self.state.done_here:
            self.status = chat_pb2.RUN_STATUS_CANCELLING

    def finish(self, status: chat_pb2.RunStatus) -> None:
        """The run has ended: followers get the remaining events, then their streams end."""
        self._state = check_move(self.info.run_id, self._state, RunState.ENDED)
        self.status = status
        self.ended_at = time.monotonic()
        self._changed.notify()
        self._ended.notify()

    def hand_over(self) -> None:
        """The run goes on on another replica (or its end is read from Cassandra): followers get the
        events here, then UNAVAILABLE, and resume from their last sequence number wherever their next
        call lands."""
        self._state = check_move(self.info.run_id, self._state, RunState.HANDED_OVER)
        self._changed.notify()
        self._ended.notify()

    async def follow(self, after_seq: int, merge_deltas: bool = False) -> AsyncIterator[chat_pb2.RunEvent]:
        """Events with seq > after_seq, then live ones until the run ends (with ``merge_deltas``, the
        deltas waiting at each read as one, and after each delta sent, those that gather meanwhile
        for the stream interval)."""
        if self.subscribers >= self.max_subscribers:
            raise exhausted(
                f"run {self.info.run_id} already has {self.max_subscribers} streams attached; "
                "close one or retry later",
                1.0,
            )
        self.subscribers += 1
        METRICS.subscribers.inc()
        try:
            position = after_seq
            while True:
                while position < len(self._events):
                    event = self._merged_after(position) if merge_deltas else self.event(position + 1)
                    position = event.seq
                    yield event
                    if merge_deltas and event.HasField("delta") and self._gathers():
                        await self.pacer.gather(until=self._ended)
                if self.state is RunState.HANDED_OVER:
                    raise unavailable(
                        f"the answer goes on on another replica; resume after event {position}", 0.2
                    )
                if self.state is RunState.ENDED:
                    return
                await self._changed.wait()
        finally:
            self.subscribers -= 1
            METRICS.subscribers.dec()

    def _gathers(self) -> bool:
        """Whether a follower that just sent a delta lets the next ones gather: the replica is loaded,
        the run goes on, and its deltas come faster than the interval."""
        return not self.state.done_here and self._delta_gap_s < self.pacer.interval_s

    def text(self) -> str:
        return "".join(text for _, text, _ in self.deltas())
