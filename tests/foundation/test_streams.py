"""The client side of the Generate stream protocol: `start`, at most one `cancel`, then the end; and
reading the response side ahead of a consumer that fell behind (over real gRPC, in process)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.streams import Outbox, ReadAhead, Wakeup

START = router_pb2.GenerateRequest(start=router_pb2.GenerateStart(request_id="r"))
CANCEL = router_pb2.GenerateRequest(cancel=router_pb2.GenerateCancel())


async def sent(outbox: Outbox) -> list[str]:
    return [frame.WhichOneof("kind") async for frame in outbox.frames()]


async def test_an_outbox_sends_start_then_at_most_one_cancel_then_ends():
    outbox = Outbox(CANCEL)
    outbox.start(START)
    outbox.cancel()
    outbox.cancel()
    outbox.close()
    outbox.close()
    assert await sent(outbox) == ["start", "cancel"]


async def test_no_cancel_goes_out_after_the_request_side_is_closed():
    outbox = Outbox(CANCEL)
    outbox.start(START)
    outbox.close()
    outbox.cancel()
    assert await sent(outbox) == ["start"]


class Frames(router_pb2_grpc.RouterServiceServicer):
    """Answers every Generate with ``count`` token frames at once, then OK or ``error``."""

    def __init__(self, count: int, error: grpc.StatusCode | None = None) -> None:
        self.count, self.error = count, error

    async def Generate(self, request_iterator, context):
        for i in range(self.count):
            tokens = engine_pb2.GenerateTokens(index=i, token_ids=[i], text="x", text_ends=[1])
            yield router_pb2.GenerateResponse(tokens=tokens)
        if self.error is not None:
            await context.abort(self.error, "the engine went away")


@contextlib.asynccontextmanager
async def answering(servicer: Frames) -> AsyncIterator[router_pb2_grpc.RouterServiceStub]:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield router_pb2_grpc.RouterServiceStub(channel)
    finally:
        await server.stop(None)


async def call(stub: router_pb2_grpc.RouterServiceStub) -> grpc.aio.StreamStreamCall:
    outbox = Outbox(CANCEL)
    outbox.start(START)
    outbox.close()
    return stub.Generate(outbox.frames(), timeout=10)


async def taken_all(frames: ReadAhead, count: int) -> list[list[int]]:
    """Each take's token positions, after waiting until all ``count`` frames have arrived."""
    for _ in range(200):
        if len(frames._frames) == count:
            break
        await asyncio.sleep(0.01)
    return [[f.tokens.index for f in await frames.take()]]


async def test_a_reader_behind_takes_every_frame_that_arrived_in_one_go_then_the_end():
    async with answering(Frames(5)) as stub:
        frames = ReadAhead(await call(stub))
        assert await taken_all(frames, 5) == [[0, 1, 2, 3, 4]]
        assert await frames.take() == []  # ended OK
        await frames.finish()


async def test_takes_as_they_come_see_every_frame_once_in_order():
    async with answering(Frames(50)) as stub:
        frames = ReadAhead(await call(stub))
        seen = []
        while batch := await frames.take():
            seen += [f.tokens.index for f in batch]
        assert seen == list(range(50))


async def test_the_calls_error_comes_after_the_frames_before_it():
    async with answering(Frames(2, grpc.StatusCode.UNAVAILABLE)) as stub:
        frames = ReadAhead(await call(stub))
        assert await taken_all(frames, 2) == [[0, 1]]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await frames.take()
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_wakeup_wakes_every_waiter_at_its_next_notify_and_forgets_a_cancelled_one():
    wakeup = Wakeup()
    wakeup.notify()  # nobody waits: nothing is remembered
    woken: list[str] = []

    async def waiter(name: str) -> None:
        await wakeup.wait()
        woken.append(name)

    first, second, cancelled = (asyncio.create_task(waiter(n)) for n in ("first", "second", "cancelled"))
    await asyncio.sleep(0)
    assert woken == []
    cancelled.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cancelled
    wakeup.notify()
    await asyncio.gather(first, second)
    assert sorted(woken) == ["first", "second"]
    late = asyncio.create_task(waiter("late"))
    await asyncio.sleep(0.01)
    assert not late.done(), "a wait begun after a notify waits for the next one"
    wakeup.notify()
    await late
