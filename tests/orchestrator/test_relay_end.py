"""How a relay ends a stored run when storing the end does not go as planned (pure logic: a router
stream that plays a short answer, and a store whose finish_run fails as it is told). With real
processes: tests/orchestrator/test_store_outage.py (Cassandra down) and test_replica_loss.py (a paused
owner whose run was adopted)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from chatmesh.chat.v1 import chat_pb2
from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2
from memory_store.errors import InvalidArgument, OwnerChanged, Unavailable
from memory_store.models import Run, RunDelta, RunOutcome, RunStatus
from meshkit.pacing import StreamPacer
from orchestrator.config import ModerationConfig, RunConfig
from orchestrator.policy.moderation import create_moderator
from orchestrator.runs.checkpoints import CheckpointWriter
from orchestrator.runs.held_run import HeldRun, RunInfo
from orchestrator.runs.late_ends import LateEnds
from orchestrator.runs.relay import Relay, RelayDeps
from orchestrator.runs.run_state import RunState
from tests.fixtures.runs import stored_run

WORDS = ["Once", " upon", " a", " time"]


class Answer:
    """A router stream that relays WORDS, one token each, then `finished`."""

    async def frames(
        self, on_tokens: Callable[[engine_pb2.GenerateTokens], None]
    ) -> AsyncIterator[router_pb2.ResponseFrame]:
        for index, word in enumerate(WORDS):
            on_tokens(engine_pb2.GenerateTokens(index=index, token_ids=[index + 10], text=word))
        yield router_pb2.ResponseFrame(
            finished=engine_pb2.GenerateFinished(
                finish_reason=engine_pb2.FINISH_REASON_STOP,
                usage=engine_pb2.Usage(prompt_tokens=5, completion_tokens=len(WORDS)),
            )
        )

    def cancel(self) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class Store:
    """finish_run raises ``failure`` (while it is set); checkpoints are taken."""

    def __init__(self, failure: Exception) -> None:
        self.failure: Exception | None = failure
        self.finishes: list[RunOutcome] = []

    async def finish_run(self, run: Run, outcome: RunOutcome, output: Sequence[RunDelta] | None = None):
        self.finishes.append(outcome)
        if self.failure is not None:
            raise self.failure

    async def checkpoint_runs(self, writes: Sequence[tuple[Run, Sequence[RunDelta]]]) -> list[bool]:
        return [True for _ in writes]


async def relay_end(
    failure: Exception,
) -> tuple[HeldRun, Store, LateEnds, list[chat_pb2.RunEvent | ServiceError]]:
    """Relays the answer as a stored run whose finish_run fails with ``failure``; returns the live
    run, the store, the late ends and what a stream following the run got: its events, and the error
    that ended it, if one did."""
    store = Store(failure)
    config = RunConfig(finish_retry_s=0.3)
    late_ends = LateEnds(store, deadline_s=1.0)  # type: ignore[arg-type]
    checkpoints = CheckpointWriter(store, 32, 0.5, deadline_s=1.0)  # type: ignore[arg-type]
    deps = RelayDeps(
        store,  # type: ignore[arg-type]
        create_moderator(ModerationConfig(enabled=False)),
        config,
        None,  # type: ignore[arg-type]  # no failover: the answer's one stream ends well
        checkpoints,
        late_ends,
    )
    run = stored_run("run-1")
    info = RunInfo(run.run_id, run.user_id, "pro", "send", "model", 16, run.chat_id, "q", "a")
    live = HeldRun(info, max_subscribers=4, pacer=StreamPacer(0.0))
    live.append(started=chat_pb2.RunStarted(run_id=run.run_id))
    start = router_pb2.GenerateStart(request_id="r", prompt_token_ids=[1, 2, 3, 4, 5])
    relay = Relay(deps, live, Answer(), start, run, arrived_at=0.0)  # type: ignore[arg-type]
    followed: list[chat_pb2.RunEvent | ServiceError] = []

    async def follow() -> None:
        try:
            async for event in live.follow(0):
                followed.append(event)
        except ServiceError as exc:
            followed.append(exc)

    follower = asyncio.create_task(follow())
    await relay.run()
    await follower
    await checkpoints.close()
    return live, store, late_ends, followed


def deltas(followed: list[chat_pb2.RunEvent | ServiceError]) -> list[str]:
    return [e.delta.text for e in followed if isinstance(e, chat_pb2.RunEvent) and e.HasField("delta")]


async def test_an_end_cassandra_does_not_take_in_time_fails_the_streams_and_waits_to_be_stored() -> None:
    live, store, late_ends, followed = await relay_end(Unavailable("down"))
    assert len(store.finishes) > 1  # retried for finish_retry_s
    assert deltas(followed) == WORDS
    last = followed[-1]
    assert isinstance(last, chat_pb2.RunEvent)
    error = last.error
    assert error.code == "UNAVAILABLE" and "stored later" in error.message
    assert live.status == chat_pb2.RUN_STATUS_FAILED
    # What waits is the end the streams were told: FAILED at the error's seq, with all the output.
    waiting = late_ends._ends["run-1"]
    assert waiting.outcome.status is RunStatus.FAILED and waiting.outcome.last_seq == last.seq
    assert (waiting.outcome.error_code, waiting.outcome.error_message) == (error.code, error.message)
    assert [d.text for d in waiting.output] == WORDS
    # Storing it is that same finish, which lands once Cassandra is back.
    store.failure = None
    assert await late_ends.store_all() == 0
    assert store.finishes[-1] == waiting.outcome


async def test_an_owner_that_finds_its_run_adopted_at_its_end_hands_its_streams_over() -> None:
    live, store, late_ends, followed = await relay_end(OwnerChanged("adopted"))
    assert len(store.finishes) == 1
    # Its streams get the deltas, then are told to resume where the run goes on; nothing ends here.
    assert live.state is RunState.HANDED_OVER and deltas(followed) == WORDS
    told = followed[-1]
    assert isinstance(told, ServiceError) and told.code.name == "UNAVAILABLE"
    assert "another replica" in told.message
    assert late_ends._ends == {}


async def test_an_end_the_store_refuses_fails_the_streams_and_nothing_waits() -> None:
    live, store, late_ends, followed = await relay_end(InvalidArgument("refused"))
    assert live.status == chat_pb2.RUN_STATUS_FAILED
    assert len(store.finishes) == 1  # no retry would take it
    last = followed[-1]
    assert isinstance(last, chat_pb2.RunEvent) and last.error.code == "UNAVAILABLE"
    assert "regenerate" in last.error.message
    assert late_ends._ends == {}
