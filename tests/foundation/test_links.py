"""A request's feed on a shared link: frames wait for the caller's ``take``, or, for a caller that
takes token frames where they arrive (``on_tokens``), go straight to it while nothing waits before them."""

import asyncio

import pytest

from chatmesh.engine.v1 import engine_pb2
from meshkit.links import LinkMessages, RequestFeed, ServedRequests

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
