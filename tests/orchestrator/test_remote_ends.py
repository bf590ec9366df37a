"""The owner's watch over its stored runs (pure logic: a store that answers from memory, runs that only
record how they were stopped). Real replicas: test_runs.py (a cancel on another replica stops the
owner) and test_replica_loss.py (a paused owner whose run was adopted leaves it)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from memory_store.errors import Unavailable
from memory_store.models import Run, RunStatus
from orchestrator.runs.remote_ends import CLOCK_SKEW_S, READ_GAP_S, SIGNAL_POLL_S, SWEEP_S, RemoteEnds
from orchestrator.runs.run_state import Stop
from tests.fixtures.runs import OWNER, stored_run


@dataclasses.dataclass
class Info:
    run_id: str
    user_id: str = "user-1"


@dataclasses.dataclass
class Live:
    info: Info


class Held:
    """What RemoteEnds sees of a Relay."""

    def __init__(self, run_id: str, stored: bool = True) -> None:
        self.live = Live(Info(run_id))
        self.stored_run = stored_run(run_id) if stored else None
        self.stop_reason: Stop | None = None

    def stop(self, reason: Stop) -> None:
        self.stop_reason = reason


class Store:
    """Runs as Cassandra holds them, the signals written, and what was read."""

    def __init__(self) -> None:
        self.runs: dict[str, Run] = {}
        self.signals: set[str] = set()
        self.windows: list[tuple[datetime, datetime]] = []
        self.reads: list[str] = []
        self.down = False

    async def signalled_runs(self, owner_id: str, since: datetime, until: datetime) -> set[str]:
        assert owner_id == OWNER
        if self.down:
            raise Unavailable("Cassandra is unreachable")
        self.windows.append((since, until))
        return set(self.signals)

    async def get_run(self, user_id: str, run_id: str) -> Run:
        if self.down:
            raise Unavailable("Cassandra is unreachable")
        self.reads.append(run_id)
        return self.runs[run_id]


class Clocks:
    def __init__(self) -> None:
        self.wall = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
        self.mono = 1000.0

    def advance(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.mono += seconds


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


def watch(store: Store, held: list[Held], clocks: Clocks) -> RemoteEnds:
    return RemoteEnds(
        store,
        OWNER,
        lambda: held,
        deadline_s=1.0,
        clock=lambda: clocks.wall,
        monotonic=lambda: clocks.mono,
    )


def holding(store: Store, *run_ids: str) -> list[Held]:
    for run_id in run_ids:
        store.runs[run_id] = stored_run(run_id)
    return [Held(run_id) for run_id in run_ids]


async def test_only_the_signalled_runs_are_read_and_each_is_stopped_as_its_state_says(clocks: Clocks) -> None:
    store = Store()
    cancelled, adopted, quiet = held = holding(store, "run-cancelled", "run-adopted", "run-quiet")
    ends = watch(store, held, clocks)
    store.runs["run-cancelled"] = dataclasses.replace(stored_run("run-cancelled"), status=RunStatus.CANCELLED)
    store.runs["run-adopted"] = dataclasses.replace(stored_run("run-adopted"), owner_id="replica-b")
    store.signals = {"run-cancelled", "run-adopted", "run-of-another-replica"}

    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()

    assert sorted(store.reads) == ["run-adopted", "run-cancelled"]
    assert cancelled.stop_reason is Stop.CANCELLED
    assert adopted.stop_reason is Stop.SUPERSEDED
    assert quiet.stop_reason is None


async def test_a_signal_for_a_run_still_in_progress_here_stops_nothing(clocks: Clocks) -> None:
    store = Store()
    held = holding(store, "run-1")
    ends = watch(store, held, clocks)
    store.signals = {"run-1"}  # written before the end it announces is visible
    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()
    assert store.reads == ["run-1"] and held[0].stop_reason is None


async def test_each_pass_reads_the_signals_since_the_last_widened_by_the_clock_skew(clocks: Clocks) -> None:
    store = Store()
    ends = watch(store, holding(store, "run-1"), clocks)
    started = clocks.wall
    skew = timedelta(seconds=CLOCK_SKEW_S)
    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()
    first_until = clocks.wall
    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()
    assert store.windows == [(started - skew, first_until + skew), (first_until - skew, clocks.wall + skew)]


async def test_signals_not_read_are_read_in_the_next_pass(clocks: Clocks) -> None:
    store = Store()
    held = holding(store, "run-1")
    ends = watch(store, held, clocks)
    started = clocks.wall
    store.down = True
    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()  # nothing read, nothing raised
    store.down = False
    store.runs["run-1"] = dataclasses.replace(stored_run("run-1"), status=RunStatus.CANCELLED)
    store.signals = {"run-1"}
    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()
    assert store.windows == [
        (started - timedelta(seconds=CLOCK_SKEW_S), clocks.wall + timedelta(seconds=CLOCK_SKEW_S))
    ]
    assert held[0].stop_reason is Stop.CANCELLED


async def test_every_run_is_read_once_a_sweep_even_unsignalled(clocks: Clocks) -> None:
    # A lost signal (its writer died after ending the run) costs the owner a sweep at most.
    store = Store()
    held = holding(store, "run-1", "run-2")
    ends = watch(store, held, clocks)
    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()  # first seen: not read yet
    first_seen = clocks.mono
    store.runs["run-2"] = dataclasses.replace(stored_run("run-2"), status=RunStatus.CANCELLED)
    while clocks.mono < first_seen + SWEEP_S - SIGNAL_POLL_S:
        clocks.advance(SIGNAL_POLL_S)
        await ends.poll()
    assert store.reads == []
    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()
    assert sorted(store.reads) == ["run-1", "run-2"]
    assert held[1].stop_reason is Stop.CANCELLED and held[0].stop_reason is None
    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()  # read a moment ago: not again until the next sweep
    assert len(store.reads) == 2


async def test_after_a_long_gap_every_run_is_read_rather_than_the_gaps_signals(clocks: Clocks) -> None:
    # Paused (or cut off from Cassandra) longer than READ_GAP_S, the owner may have missed signals.
    store = Store()
    held = holding(store, "run-1", "run-2")
    ends = watch(store, held, clocks)
    store.runs["run-1"] = dataclasses.replace(stored_run("run-1"), owner_id="replica-b")
    clocks.advance(READ_GAP_S + 1)
    await ends.poll()
    assert store.windows == []
    assert sorted(store.reads) == ["run-1", "run-2"]
    assert held[0].stop_reason is Stop.SUPERSEDED and held[1].stop_reason is None
    clocks.advance(SIGNAL_POLL_S)
    await ends.poll()  # back to reading signals from the pass before
    assert len(store.windows) == 1


async def test_runs_not_stored_or_already_stopping_are_not_watched(clocks: Clocks) -> None:
    store = Store()
    stopping = Held("run-stopping")
    stopping.stop_reason = Stop.CANCELLED
    held = [Held("run-complete", stored=False), stopping]
    ends = watch(store, held, clocks)
    store.signals = {"run-complete", "run-stopping"}
    clocks.advance(READ_GAP_S + 1)
    await ends.poll()
    assert store.reads == []
