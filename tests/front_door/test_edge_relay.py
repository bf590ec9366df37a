"""The edge's relay: events that arrive while the client is being written to go out as one write, in
order and each once; OpenAI's chunks merge consecutive deltas (the scripted and real meshes in the other
tests cover the same relay end to end)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc

from chatmesh.chat.v1 import chat_pb2
from edge.drain import Drain
from edge.openai_api import ChunkWriter
from edge.sse import each, relay, run_event_sse


def started(seq: int = 0) -> chat_pb2.RunEvent:
    return chat_pb2.RunEvent(seq=seq, started=chat_pb2.RunStarted(run_id="r1"))


def delta(seq: int, text: str) -> chat_pb2.RunEvent:
    return chat_pb2.RunEvent(seq=seq, delta=chat_pb2.Delta(text=text, token_count=1))


def done(seq: int) -> chat_pb2.RunEvent:
    return chat_pb2.RunEvent(seq=seq, done=chat_pb2.Done(finish_reason=chat_pb2.FINISH_REASON_STOP))


class QueuedStream:
    """A RunStream whose events after the first are put by the test; None ends it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[chat_pb2.RunEvent | grpc.RpcError | None] = asyncio.Queue()
        self.detached = False

    async def rest(self):
        while (event := await self.queue.get()) is not None:
            if isinstance(event, grpc.RpcError):
                raise event
            yield event

    def detach(self) -> None:
        self.detached = True


def page_relay(stream: QueuedStream):
    return relay(
        stream,  # type: ignore[arg-type]
        started(),
        "run",
        time.monotonic(),
        Drain(),
        each(lambda event: [run_event_sse(event)]),
        lambda error: [],
    )


def ids(chunk: bytes) -> list[str]:
    return [line[4:] for line in chunk.decode().splitlines() if line.startswith("id: ")]


async def settle() -> None:
    """Lets the relay's reading task take everything queued so far."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_events_that_arrive_while_the_client_is_written_go_out_as_one_write_in_order():
    stream = QueuedStream()
    writes = page_relay(stream)
    assert ids(await anext(writes)) == ["0"]  # the first event at once
    for seq in (1, 2, 3):
        stream.queue.put_nowait(delta(seq, f"t{seq}"))
    await settle()  # the client is still being written to meanwhile
    assert ids(await anext(writes)) == ["1", "2", "3"]
    stream.queue.put_nowait(delta(4, "t4"))
    assert ids(await anext(writes)) == ["4"]  # a client that keeps up gets each event alone
    stream.queue.put_nowait(done(5))
    stream.queue.put_nowait(None)
    assert ids(await anext(writes)) == ["5"]
    assert [chunk async for chunk in writes] == []
    assert stream.detached


async def test_an_error_mid_stream_comes_after_the_events_before_it():
    stream = QueuedStream()
    writes = relay(
        stream,  # type: ignore[arg-type]
        started(),
        "run",
        time.monotonic(),
        Drain(),
        each(lambda event: [run_event_sse(event)]),
        lambda error: [run_event_sse(chat_pb2.RunEvent(seq=99))],
    )
    await anext(writes)
    stream.queue.put_nowait(delta(1, "a"))
    stream.queue.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, None, None, "boom"))
    await settle()
    assert ids(await anext(writes)) == ["1"]
    assert ids(await anext(writes)) == ["99"]
    assert [chunk async for chunk in writes] == [] and stream.detached


def test_openai_chunks_merge_consecutive_deltas_and_keep_everything_else_in_order():
    writer = ChunkWriter("chatcmpl-1", "m", include_usage=False)
    batch = [started(), delta(1, "Hel"), delta(2, "lo"), delta(3, ","), done(4)]
    chunks = [json.loads(item.data) for item in writer.events(batch)]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello,"},
        {},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert [json.loads(i.data)["choices"][0]["delta"] for i in writer.events([delta(5, "x")])] == [
        {"content": "x"}
    ]
