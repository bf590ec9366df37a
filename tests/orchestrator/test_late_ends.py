"""Late run ends (pure logic: a store that answers finish_run as it is told). A real orchestrator whose
run's end waits for Cassandra to come back: tests/orchestrator/test_store_outage.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from chatmesh.finish import FinishReason
from memory_store.errors import InvalidArgument, OwnerChanged, Unavailable
from memory_store.models import Run, RunDelta, RunOutcome, RunStatus
from orchestrator.metrics import METRICS
from orchestrator.runs.late_ends import LateEnds
from tests.fixtures.runs import stored_run

FAILED = RunOutcome(RunStatus.FAILED, 3, FinishReason.ERROR, error_code="UNAVAILABLE", error_message="later")
OUTPUT = [RunDelta(2, "Hi", 1)]


class Store:
    """Records each finish_run; answers it with the next of ``answers`` (an exception is raised, None
    stands for a finish that took)."""

    def __init__(self, *answers: Exception | None) -> None:
        self.answers = list(answers)
        self.finished: list[tuple[str, RunOutcome, Sequence[RunDelta] | None]] = []

    async def finish_run(self, run: Run, outcome: RunOutcome, output: Sequence[RunDelta] | None = None):
        self.finished.append((run.run_id, outcome, output))
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            raise answer


def done(outcome: str) -> float:
    value = METRICS.registry.get_sample_value(
        "chatmesh_orchestrator_late_run_ends_total", {"outcome": outcome}
    )
    return value or 0.0


def waiting() -> float | None:
    return METRICS.registry.get_sample_value("chatmesh_orchestrator_late_run_ends_waiting")


async def test_an_end_is_tried_each_pass_until_it_lands_then_forgotten() -> None:
    store = Store(Unavailable("down"), Unavailable("still down"), None)
    ends = LateEnds(store, deadline_s=1.0)
    ends.add(stored_run("run-1"), FAILED, OUTPUT)
    stored_before = done("stored")
    assert await ends.store_all() == 1
    assert await ends.store_all() == 1
    assert waiting() == 1
    assert await ends.store_all() == 0
    # Each try is the same finish: the end its clients were told, with the whole output.
    assert store.finished == [("run-1", FAILED, OUTPUT)] * 3
    assert done("stored") == stored_before + 1 and waiting() == 0
    assert await ends.store_all() == 0 and len(store.finished) == 3


async def test_a_pass_stops_at_the_first_end_cassandra_does_not_take() -> None:
    store = Store(None, Unavailable("down"))
    ends = LateEnds(store, deadline_s=1.0)
    for i in range(4):
        ends.add(stored_run(f"run-{i}"), FAILED, OUTPUT)
    assert await ends.store_all() == 3
    assert [run_id for run_id, _, _ in store.finished] == ["run-0", "run-1"]
    assert await ends.store_all() == 0  # the next pass goes on from the one that failed
    assert [run_id for run_id, _, _ in store.finished][2:] == ["run-1", "run-2", "run-3"]


async def test_a_finish_that_hangs_counts_as_a_failure_of_the_pass() -> None:
    class Hanging(Store):
        async def finish_run(self, run, outcome, output=None):
            self.finished.append((run.run_id, outcome, output))
            if len(self.finished) == 1:
                await asyncio.sleep(60)

    store = Hanging()
    ends = LateEnds(store, deadline_s=0.05)
    ends.add(stored_run("run-1"), FAILED, OUTPUT)
    ends.add(stored_run("run-2"), FAILED, OUTPUT)
    assert await ends.store_all() == 2
    assert await ends.store_all() == 0


async def test_a_run_another_replica_owns_or_that_the_store_refuses_is_dropped() -> None:
    store = Store(OwnerChanged("adopted"), InvalidArgument("bad"))
    ends = LateEnds(store, deadline_s=1.0)
    taken_before, dropped_before = done("taken_over"), done("dropped")
    ends.add(stored_run("adopted"), FAILED, OUTPUT)
    ends.add(stored_run("refused"), FAILED, OUTPUT)
    assert await ends.store_all() == 0
    assert done("taken_over") == taken_before + 1 and done("dropped") == dropped_before + 1
