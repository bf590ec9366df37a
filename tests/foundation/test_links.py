"""A request's feed on a shared link: frames wait for the caller's ``take``, or, for a caller that
takes token frames where they arrive (``on_tokens``), go straight to it while nothing waits before them;
and a link to a scripted peer over real gRPC: a caller that fell behind takes what came meanwhile in one
go, the request's error after the frames before it, one start and at most one cancel per request."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from meshkit.links import Link, LinkMessages, RequestFeed, ServedRequests

ACCEPTED = engine_pb2.ResponseFrame(request_id="r", accepted=engine_pb2.GenerateAccepted())
FINISHED = engine_pb2.ResponseFrame(request_id="r", finished=engine_pb2.GenerateFinished())


def tokens(index: int) -> engine_pb2.ResponseFrame:
    return engine_pb2.ResponseFrame(
        request_id="r", tokens=engine_pb2.GenerateTokens(index=index, token_ids=[index], text="x")
    )


async def test_token_frames_go_to_the_caller_as_they_arrive_and_the_rest_waits_for_take():
    feed, handed = RequestFeed(), []
    feed.on_tokens = handed.append
    feed.add(tokens(0))
    feed.add(tokens(1))
    assert [t.index for t in handed] == [0, 1] and not feed.queued
    feed.add(FINISHED)
    assert await feed.take() == [FINISHED] and feed.ended


async def test_tokens_behind_a_frame_not_taken_yet_wait_behind_it_in_order():
    feed, handed = RequestFeed(), []
    feed.on_tokens = handed.append
    feed.add(ACCEPTED)
    feed.add(tokens(0))  # the caller has not taken `accepted`: this one must not pass it
    assert handed == [] and await feed.take() == [ACCEPTED, tokens(0)]
    feed.add(tokens(1))
    assert [t.index for t in handed] == [1]


async def test_what_the_callers_handler_raises_ends_this_feed_with_it():
    feed = RequestFeed()

    def refuse(payload: engine_pb2.GenerateTokens) -> None:
        raise ValueError("no")

    feed.on_tokens = refuse
    feed.add(tokens(0))  # the link's reader is not hurt: the error is the request's
    assert feed.ended
    with pytest.raises(ValueError, match="no"):
        await feed.take()


async def test_nothing_is_added_after_the_end():
    feed, handed = RequestFeed(), []
    feed.add(FINISHED)
    feed.on_tokens = handed.append
    feed.add(tokens(0))
    assert await feed.take() == [FINISHED] and handed == []
    assert await asyncio.wait_for(feed.take(), 1) == []


async def test_a_frame_that_waits_is_copied_out_of_the_message_that_brought_it():
    # A view into the peer's message would keep all of it (every request's frames) in memory for as
    # long as the request keeps what it took.
    message = engine_pb2.GenerateManyResponse(frames=[ACCEPTED, tokens(0)])
    feed = RequestFeed()
    for frame in message.frames:
        feed.add(frame)
    message.frames[0].request_id = "changed"
    message.frames[1].tokens.text = "changed"
    taken = await feed.take()
    assert [frame.request_id for frame in taken] == ["r", "r"]
    assert taken[1].tokens.text == "x"


class _StartsKept(ServedRequests):
    """Keeps each start it is given, and ends its request at once."""

    def __init__(self) -> None:
        super().__init__(LinkMessages.of(engine_pb2), lambda: False)
        self.starts: list[engine_pb2.GenerateStart] = []

    def start(self, request_id: str, frame: engine_pb2.RequestFrame) -> None:
        self.starts.append(frame.start)
        finished = engine_pb2.ResponseFrame(request_id=request_id, finished=engine_pb2.GenerateFinished())
        self.end(request_id, finished)


async def test_a_served_start_is_copied_out_of_the_message_that_brought_it():
    message = engine_pb2.GenerateManyRequest(
        frames=[
            engine_pb2.RequestFrame(
                request_id=name, start=engine_pb2.GenerateStart(request_id=name, prompt_token_ids=[1, 2])
            )
            for name in ("a", "b")
        ]
    )

    async def requests():
        yield message

    served = _StartsKept()
    responses = [response async for response in served.serve(requests(), set())]
    assert {frame.request_id for response in responses for frame in response.frames} == {"a", "b"}
    message.frames[0].start.prompt_token_ids[0] = 9
    assert [list(start.prompt_token_ids) for start in served.starts] == [[1, 2], [1, 2]]


# -- a link to a scripted peer, over real gRPC in process ---------------------------------------------

ROUTER_LINK = LinkMessages.of(router_pb2)


class _Answers(router_pb2_grpc.RouterServiceServicer):
    """Answers each start with ``count`` token frames, a message each, then `finished`, its `failed` with
    ``error``, or (``ends`` False) nothing until the request's `cancel`, answered with `finished`.
    Records each request's frame kinds as they came; ``closed`` is set when the client half-closes."""

    def __init__(self, count: int, error: ServiceError | None = None, ends: bool = True) -> None:
        self.count, self.error, self.ends = count, error, ends
        self.received: dict[str, list[str]] = {}
        self.closed = asyncio.Event()

    async def GenerateMany(self, request_iterator, context):
        async for message in request_iterator:
            for frame in message.frames:
                kind = frame.WhichOneof("kind")
                self.received.setdefault(frame.request_id, []).append(kind)
                if kind == "cancel":
                    yield self._message(frame.request_id, finished=engine_pb2.GenerateFinished())
                    continue
                for i in range(self.count):
                    tokens = engine_pb2.GenerateTokens(index=i, token_ids=[i], text="x", text_ends=[1])
                    yield self._message(frame.request_id, tokens=tokens)
                if self.error is not None:
                    yield self._message(
                        frame.request_id, failed=engine_pb2.GenerateFailed(status=self.error.status())
                    )
                elif self.ends:
                    yield self._message(frame.request_id, finished=engine_pb2.GenerateFinished())
        self.closed.set()

    @staticmethod
    def _message(request_id: str, **kind: Any) -> router_pb2.GenerateManyResponse:
        return router_pb2.GenerateManyResponse(
            frames=[router_pb2.ResponseFrame(request_id=request_id, **kind)]
        )


@contextlib.asynccontextmanager
async def _link_to(servicer: _Answers) -> AsyncIterator[Link]:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Link(router_pb2_grpc.RouterServiceStub(channel).GenerateMany, ROUTER_LINK, "the router")
    finally:
        await server.stop(None)


def _start(request_id: str) -> router_pb2.GenerateStart:
    return router_pb2.GenerateStart(request_id=request_id, prompt_token_ids=[1])


async def _arrived(feed: RequestFeed, count: int) -> None:
    """Until ``count`` frames wait in ``feed`` (the caller has fallen behind)."""
    for _ in range(500):
        if feed.queued == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{feed.queued} frames arrived, not {count}")


def _positions(frames: list[router_pb2.ResponseFrame]) -> list[int | str]:
    return [f.tokens.index if f.WhichOneof("kind") == "tokens" else f.WhichOneof("kind") for f in frames]


async def test_a_caller_behind_takes_every_frame_that_arrived_in_one_go_then_the_end():
    async with _link_to(_Answers(5)) as link:
        feed = link.open(_start("r"), {})
        await _arrived(feed, 6)
        assert _positions(await feed.take()) == [0, 1, 2, 3, 4, "finished"]
        assert await feed.take() == []  # ended well
        link.release("r")


async def test_takes_as_they_come_see_every_frame_once_in_order():
    async with _link_to(_Answers(50)) as link:
        feed, seen = link.open(_start("r"), {}), []
        while batch := await feed.take():
            seen += _positions(batch)
        assert seen == [*range(50), "finished"]
        link.release("r")


async def test_the_requests_error_comes_after_the_frames_before_it():
    gone = ServiceError(grpc.StatusCode.UNAVAILABLE, "the engine went away", retry_after_s=2.0)
    async with _link_to(_Answers(2, gone)) as link:
        feed = link.open(_start("r"), {})
        await _arrived(feed, 2)
        assert _positions(await feed.take()) == [0, 1]
        with pytest.raises(ServiceError) as raised:
            await feed.take()
        assert (raised.value.code, raised.value.message) == (
            grpc.StatusCode.UNAVAILABLE,
            "the engine went away",
        )
        assert raised.value.retry_after_s == 2.0
        link.release("r")


async def test_a_request_sends_one_start_at_most_one_cancel_and_none_once_it_has_ended():
    answers = _Answers(0, ends=False)
    async with _link_to(answers) as link:
        cancelled = link.open(_start("cancelled"), {})
        link.cancel("cancelled")
        link.cancel("cancelled")
        assert _positions(await cancelled.take()) == ["finished"]
        link.release("cancelled")
        link.cancel("cancelled")  # released: forgotten
        answers.ends = True
        ended = link.open(_start("ended"), {})
        assert _positions(await ended.take()) == ["finished"]
        link.cancel("ended")  # it ended: no cancel goes out
        link.release("ended")
        link.renew()  # the stream has no request left: it half-closes
        await asyncio.wait_for(answers.closed.wait(), 10)
    assert answers.received == {"cancelled": ["start", "cancel"], "ended": ["start"]}
