"""The relay's own rules, without engines: token positions across attempts, and what a request that
failed everywhere is told."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2
from meshkit.links import RequestFeed
from router.config import RouterConfig
from router.engines import ENGINE_LINK
from router.metrics import RouterMetrics
from router.placement import Placement, RequestPlan
from router.routed_request import AttemptFailed, RoutedRequest


def relay() -> RoutedRequest:
    start = router_pb2.GenerateStart(request_id="r", prompt_token_ids=[1, 2, 3])
    return RoutedRequest(
        start, RequestPlan("r", [1, 2, 3]), None, RouterConfig(), RouterMetrics(CollectorRegistry())
    )


def tokens(index: int, *ids: int) -> engine_pb2.GenerateTokens:
    return engine_pb2.GenerateTokens(index=index, token_ids=ids, text="x")


def test_tokens_continue_from_what_the_client_has_and_repeats_are_dropped():
    r = relay()
    assert list(r._new_tokens(tokens(0, 10, 11)).token_ids) == [10, 11]
    assert r._new_tokens(tokens(1, 11)) is None  # already sent
    trimmed = r._new_tokens(tokens(1, 11, 12, 13))
    assert (trimmed.index, list(trimmed.token_ids)) == (2, [12, 13])
    assert list(r.output) == [10, 11, 12, 13]


def test_per_token_text_ends_pass_through_and_a_trimmed_frame_drops_the_text_the_client_has():
    r = relay()
    first = engine_pb2.GenerateTokens(index=0, token_ids=[10, 11], text="Hi, ", text_ends=[2, 4])
    assert r._new_tokens(first) == first
    repeat = engine_pb2.GenerateTokens(index=1, token_ids=[11, 12, 13], text=", you!", text_ends=[2, 5, 6])
    trimmed = r._new_tokens(repeat)
    assert (trimmed.index, list(trimmed.token_ids), trimmed.text) == (2, [12, 13], "you!")
    assert list(trimmed.text_ends) == [3, 4]


def test_a_gap_in_token_positions_fails_the_attempt():
    r = relay()
    r._new_tokens(tokens(0, 10))
    with pytest.raises(AttemptFailed, match=r"skipped output positions 1\.\.2"):
        r._new_tokens(tokens(3, 13))


def test_giving_up_says_what_every_engine_said():
    failures = [
        ("e0", AttemptFailed("unavailable", "UNAVAILABLE: Socket closed")),
        ("e1", AttemptFailed("timeout", "nothing within 30s (waiting for the next token)")),
    ]
    err = RoutedRequest._give_up(failures)
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.retry_after_s is None
    assert "failed on 2 engine(s): e0: UNAVAILABLE: Socket closed; e1: nothing within 30s" in err.message


def test_when_every_engine_tried_was_full_the_answer_is_resource_exhausted_with_the_soonest_retry():
    failures = [
        ("e0", AttemptFailed("exhausted", "queue full", retry_after_s=2.0)),
        ("e1", AttemptFailed("exhausted", "queue full", retry_after_s=0.7)),
    ]
    err = RoutedRequest._give_up(failures)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s == 0.7


class ArrivedLink:
    """A link to an engine whose frames for the request have all arrived already: what a relay finds
    when it fell behind."""

    messages = ENGINE_LINK

    def __init__(self, frames: list[engine_pb2.ResponseFrame]) -> None:
        self.feed = RequestFeed()
        for frame in frames:
            self.feed.add(frame)
        self.released: list[str] = []

    def open(self, start, trace_context) -> RequestFeed:
        return self.feed

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def engine_answering(frames: list[engine_pb2.ResponseFrame]) -> SimpleNamespace:
    return SimpleNamespace(
        engine_id="e0",
        info=None,
        link=ArrivedLink(frames),
        progressed=lambda request_id, tokens: None,
        ended=lambda request_id, completed: None,
    )


async def test_token_frames_that_arrived_before_the_relay_took_them_go_out_as_one():
    r = relay()
    r.placer = SimpleNamespace(remember=lambda plan, engine, output: None)
    frames = [
        engine_pb2.ResponseFrame(request_id="r", accepted=engine_pb2.GenerateAccepted()),
        engine_pb2.ResponseFrame(
            request_id="r",
            tokens=engine_pb2.GenerateTokens(index=0, token_ids=[10, 11], text="Hi", text_ends=[1, 2]),
        ),
        engine_pb2.ResponseFrame(
            request_id="r",
            tokens=engine_pb2.GenerateTokens(index=2, token_ids=[12], text=" you", text_ends=[4]),
        ),
        engine_pb2.ResponseFrame(
            request_id="r", finished=engine_pb2.GenerateFinished(finish_reason=engine_pb2.FINISH_REASON_STOP)
        ),
    ]
    engine = engine_answering(frames)
    placement = Placement(engine, predicted_cached_tokens=0, model="m")
    sent: list[router_pb2.ResponseFrame] = []
    await r._stream(placement, "r", 0.0, sent.append)
    assert [frame.WhichOneof("kind") for frame in sent] == ["tokens", "finished"]
    merged = sent[0].tokens
    assert (merged.index, list(merged.token_ids), merged.text, list(merged.text_ends)) == (
        0,
        [10, 11, 12],
        "Hi you",
        [1, 2, 6],
    )
    assert list(r.output) == [10, 11, 12] and sent[1].finished.usage.completion_tokens == 3
    assert engine.link.released == ["r"]  # the relay lets go of the request once it has ended


def token_frame(index: int, *ids: int) -> engine_pb2.ResponseFrame:
    return engine_pb2.ResponseFrame(request_id="r", tokens=tokens(index, *ids))


async def relay_live(
    r: RoutedRequest, sent: list[router_pb2.ResponseFrame]
) -> tuple[asyncio.Task[None], RequestFeed]:
    """``r``'s attempt on an engine whose frames the test adds as they come, once `accepted` is in."""
    r.placer = SimpleNamespace(remember=lambda plan, engine, output: None)
    engine = engine_answering([])
    attempt = asyncio.create_task(r._stream(Placement(engine, 0, "m"), "r", 0.0, sent.append))
    feed = engine.link.feed
    feed.add(engine_pb2.ResponseFrame(request_id="r", accepted=engine_pb2.GenerateAccepted()))
    await asyncio.sleep(0)  # the relay takes `accepted`
    return attempt, feed


async def test_once_tokens_flow_each_frame_is_relayed_as_it_arrives_and_the_relay_wakes_for_the_end():
    r, sent = relay(), []
    attempt, feed = await relay_live(r, sent)
    feed.add(token_frame(0, 10))
    assert [frame.tokens.index for frame in sent] == [0]  # relayed within `add`, by the link's reader
    feed.add(token_frame(1, 11, 12))
    assert [frame.tokens.index for frame in sent] == [0, 1] and list(r.output) == [10, 11, 12]
    assert not attempt.done() and not feed.queued
    feed.add(FINISHED)
    await attempt
    assert [frame.WhichOneof("kind") for frame in sent] == ["tokens", "tokens", "finished"]
    assert sent[-1].finished.usage.completion_tokens == 3


async def test_a_gap_in_token_positions_relayed_as_they_arrive_fails_the_attempt():
    r, sent = relay(), []
    attempt, feed = await relay_live(r, sent)
    feed.add(token_frame(0, 10))
    feed.add(token_frame(2, 12))
    with pytest.raises(AttemptFailed, match=r"skipped output positions 1\.\.1") as failed:
        await attempt
    assert failed.value.failure == "protocol" and len(sent) == 1


async def test_the_idle_timeout_still_ends_an_attempt_whose_tokens_stopped_coming():
    r, sent = relay(), []
    r.config = RouterConfig(idle_timeout_s=0.05)
    attempt, feed = await relay_live(r, sent)
    feed.add(token_frame(0, 10))
    with pytest.raises(AttemptFailed, match=r"nothing within 0.05s \(waiting for the next token\)"):
        await attempt
    assert len(sent) == 1


class ScriptedLink(ArrivedLink):
    """A link whose request gets ``frames`` and then, if given, ``error``; it keeps the start it was sent."""

    def __init__(self, frames: list[engine_pb2.ResponseFrame], error: ServiceError | None = None) -> None:
        super().__init__(frames)
        if error is not None:
            self.feed.end(error)
        self.started: engine_pb2.GenerateStart | None = None

    def open(self, start, trace_context) -> RequestFeed:
        self.started = start
        return self.feed


def scripted_engine(engine_id: str, link: ScriptedLink) -> SimpleNamespace:
    return SimpleNamespace(
        engine_id=engine_id,
        info=None,
        link=link,
        start_to_first_token_s=lambda prefill_tokens: 0.1,
        dispatched=lambda request_id, tokens, rank, cached_tokens: None,
        progressed=lambda request_id, tokens: None,
        ended=lambda request_id, completed: None,
    )


class ScriptedPlacer:
    """Places each attempt on the next engine of its list."""

    def __init__(self, *engines: SimpleNamespace) -> None:
        self.engines = list(engines)
        self.placed = 0

    def place(self, plan, exclude, admit) -> Placement:
        engine = self.engines[self.placed]
        self.placed += 1
        return Placement(engine, predicted_cached_tokens=0, model="m")

    def remember(self, plan, engine, output) -> None:
        pass


def free_relay(placer: ScriptedPlacer, admission: str = "wait") -> RoutedRequest:
    start = router_pb2.GenerateStart(request_id="r", prompt_token_ids=[1, 2, 3], tier=router_pb2.TIER_FREE)
    plan = RequestPlan("r", [1, 2, 3], tier=router_pb2.TIER_FREE)
    config = RouterConfig(admission=admission)
    return RoutedRequest(start, plan, placer, config, RouterMetrics(CollectorRegistry()))  # type: ignore[arg-type]


ACCEPTED = engine_pb2.ResponseFrame(request_id="r", accepted=engine_pb2.GenerateAccepted())
FINISHED = engine_pb2.ResponseFrame(
    request_id="r", finished=engine_pb2.GenerateFinished(finish_reason=engine_pb2.FINISH_REASON_LENGTH)
)


def exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, 0.2)


async def test_an_engine_dropping_the_request_from_its_queue_ends_it_resource_exhausted_with_no_failover():
    expired = ScriptedLink([ACCEPTED], exhausted("waited 1.9s in the queue"))
    spare = ScriptedLink([ACCEPTED, FINISHED])
    placer = ScriptedPlacer(scripted_engine("e0", expired), scripted_engine("e1", spare))
    r = free_relay(placer)
    with pytest.raises(ServiceError) as refused:
        await r.run(lambda frame: None)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "free tier's time-to-first-token objective" in refused.value.message
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 0.5
    assert placer.placed == 1 and spare.started is None
    # What is left of the free tier's 2 s, less the engine's 0.1 s to a first token.
    assert 1800 <= expired.started.max_queue_ms <= 1900


async def test_a_failover_from_a_full_engine_still_carries_what_is_left_of_the_objective():
    full = ScriptedLink([], exhausted("the engine's waiting queue is full"))
    spare = ScriptedLink([ACCEPTED, FINISHED])
    placer = ScriptedPlacer(scripted_engine("e0", full), scripted_engine("e1", spare))
    frames: list[router_pb2.ResponseFrame] = []
    await free_relay(placer).run(frames.append)
    assert [frame.WhichOneof("kind") for frame in frames][-1] == "finished"
    assert placer.placed == 2
    assert 0 < spare.started.max_queue_ms <= full.started.max_queue_ms


async def test_under_the_count_rule_no_attempt_carries_a_queue_limit():
    answers = ScriptedLink([ACCEPTED, FINISHED])
    placer = ScriptedPlacer(scripted_engine("e0", answers))
    await free_relay(placer, admission="count").run(lambda frame: None)
    assert answers.started.max_queue_ms == 0
