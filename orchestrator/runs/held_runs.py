"""The runs this replica holds: the one index of them by run id, the tasks they run in, and whether the
replica still takes runs (it drains: ``drain.py``).

A run is in hand here from its admission (``starts.py``) or its adoption (``adoption.py``) on: first
by its id alone (``pending``) while it is placed and persisted, then as a ``HeldRun`` from its first
event to its hand-over, or until ``finished_ttl_s`` after its end (``sweep``). Only this index adds
runs to it and forgets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Iterator, Sequence
from typing import TypeVar

from chatmesh.chat.v1 import chat_pb2
from memory_store.models import RunDelta
from meshkit.pacing import StreamPacer
from orchestrator.config import RunConfig
from orchestrator.metrics import METRICS
from orchestrator.runs.checkpoints import decoded_logprobs
from orchestrator.runs.held_run import HeldRun, RunInfo
from orchestrator.runs.late_ends import LateEnds
from orchestrator.runs.relay import Relay, RunEnd
from orchestrator.runs.run_state import RunState, Stop
from orchestrator.runs.tool_steps import step_event

T = TypeVar("T")


class HeldRuns:
    def __init__(self, config: RunConfig, late_ends: LateEnds) -> None:
        self.config = config
        self.late_ends = late_ends
        self.pacer = StreamPacer(config.stream_interval_max_ms / 1000)
        METRICS.stream_interval.set_function(lambda: self.pacer.interval_s)
        self._runs: dict[str, HeldRun] = {}
        # The ids of runs admitted here and not yet held, and of adoptions under way (``holds``).
        self._pending: set[str] = set()
        # Every run task, from its start to its last step: the replica holds them, no client does.
        self.tasks: set[asyncio.Task[object]] = set()
        # Set as the replica drains: no new run is admitted or adopted.
        self.draining = False
        # Set once a draining replica's grace is over: every run still live here is handed over.
        self.handing_over = False
        # Runs handed over to another replica at shutdown, for ``Membership.leave``.
        self.handed_over = 0

    def task(self, work: Coroutine[object, object, T], name: str, run_id: str = "") -> asyncio.Task[T]:
        """``work`` as a task of this replica (``Drain.shutdown`` waits for it, then cancels it); with
        ``run_id``, that run is in hand here by its id until the task ends."""
        task = asyncio.create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if run_id:
            self._pending.add(run_id)
            task.add_done_callback(lambda _: self._pending.discard(run_id))
        return task

    @contextlib.contextmanager
    def pending(self, run_id: str) -> Iterator[None]:
        """The run is in hand here, by its id, until the block ends."""
        self._pending.add(run_id)
        try:
            yield
        finally:
            self._pending.discard(run_id)

    def open(self, info: RunInfo, earlier: Sequence[RunDelta] = ()) -> HeldRun:
        """The run as it starts (STARTING, not yet held): its ``started`` event, then ``earlier`` (an
        adopted run's checkpointed output)."""
        held = HeldRun(info, self.config.max_subscribers_per_run, self.pacer)
        held.append(started=_started(info))
        for delta in earlier:
            if delta.step:
                held.append(**step_event(delta.step))
            else:
                held.append_delta(delta.text, delta.token_count, decoded_logprobs(delta.logprobs))
        return held

    def hold(self, held: HeldRun) -> None:
        """The run is held here from now on: streams attach to it (``local``)."""
        self._runs[held.info.run_id] = held

    def let_go(self, held: HeldRun) -> None:
        """Forgets a run that never went live here: its streams resume from Cassandra."""
        if self._runs.pop(held.info.run_id, None) is not None:
            held.hand_over()

    async def relay(self, relay: Relay) -> RunEnd:
        """Relays a run held here to its end (or until another replica goes on with it)."""
        held = relay.live
        self.hold(held)
        held.go_live(relay)
        if self.handing_over:  # it went live after the drain's grace: it goes on elsewhere at once
            _leave_at_shutdown(relay)
        try:
            return await relay.run()
        finally:
            if held.state is RunState.HANDED_OVER:
                # New streams of the run follow it where it goes on (through Cassandra from here).
                self._runs.pop(held.info.run_id, None)
                if relay.stop_reason is Stop.HANDED_OVER:
                    self.handed_over += 1

    def hand_over_all(self) -> int:
        """From now on every run live here is handed over (a Complete interrupted); returns how many
        were live."""
        self.handing_over = True
        live = self.relays()
        for relay in live:
            _leave_at_shutdown(relay)
        return len(live)

    # -- what it holds ---------------------------------------------------------------------------

    def relays(self) -> list[Relay]:
        """The runs this replica relays now."""
        return [
            held.relay
            for held in self._runs.values()
            if held.state is RunState.LIVE and isinstance(held.relay, Relay)
        ]

    def local(self, user_id: str, run_id: str) -> HeldRun | None:
        """The user's run, if this replica holds it."""
        held = self._runs.get(run_id)
        return held if held is not None and held.info.user_id == user_id else None

    def of_chat(self, user_id: str, chat_id: str) -> list[HeldRun]:
        return [h for h in self._runs.values() if h.info.user_id == user_id and h.info.chat_id == chat_id]

    def holds(self, run_id: str) -> bool:
        """Whether this replica has the run in hand: starting it, adopting it, generating it, holding
        it after its end, or storing its end later."""
        return run_id in self._pending or run_id in self._runs or self.late_ends.holds(run_id)

    def is_running(self, run_id: str) -> bool:
        """Whether the run is starting or generating here (not ended, not handed over)."""
        held = self._runs.get(run_id)
        return held is not None and not held.state.done_here

    def sweep(self) -> None:
        """Forgets ended runs older than ``finished_ttl_s`` (Cassandra serves them from then on)."""
        horizon = time.monotonic() - self.config.finished_ttl_s
        for run_id, held in list(self._runs.items()):
            if held.ended_at is not None and held.ended_at < horizon and not held.subscribers:
                del self._runs[run_id]


def _leave_at_shutdown(relay: Relay) -> None:
    """A stored run is handed over (another replica adopts it); a Complete is interrupted."""
    relay.stop(Stop.HANDED_OVER if relay.stored_run is not None else Stop.INTERRUPTED)


def _started(info: RunInfo) -> chat_pb2.RunStarted:
    return chat_pb2.RunStarted(
        run_id=info.run_id,
        chat_id=info.chat_id,
        user_message_id=info.user_message_id,
        assistant_message_id=info.assistant_message_id,
        model=info.model,
        degraded=info.degraded,
    )
