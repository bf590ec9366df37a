"""A small client for the ``GenerateMany`` RPCs (engine.v1 and router.v1) in tests: messages of frames
sent when the test likes, and each request's frames read into an outcome that checks its contract."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass
class Many:
    """One GenerateMany call. ``outcome`` makes the per-request record (the Generate tests' ``Outcome``,
    whose ``add`` checks a request's frames: they carry the same fields as a Generate call's)."""

    call: grpc.aio.StreamStreamCall
    outbox: asyncio.Queue
    message: type  # the service's GenerateManyRequest
    outcome: Callable[[], Any]
    outcomes: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, Any] = field(default_factory=dict)  # request id -> its GenerateFailed
    messages: list[Any] = field(default_factory=list)

    @classmethod
    def open(
        cls, stub: Any, message: type, outcome: Callable[[], Any], *frames: Any, timeout_s: float = 60
    ) -> Many:
        outbox: asyncio.Queue = asyncio.Queue()

        async def requests() -> AsyncIterator[Any]:
            while (item := await outbox.get()) is not None:
                yield item

        many = cls(stub.GenerateMany(requests(), timeout=timeout_s), outbox, message, outcome)
        if frames:
            many.send(*frames)
        return many

    def send(self, *frames: Any) -> None:
        self.outbox.put_nowait(self.message(frames=frames))

    def half_close(self) -> None:
        self.outbox.put_nowait(None)

    def ended(self, request_id: str) -> bool:
        outcome = self.outcomes.get(request_id)
        return request_id in self.failed or (outcome is not None and outcome.finished is not None)

    async def until(self, done: Callable[[], bool]) -> None:
        """Reads messages until ``done()``; nothing may come for a request after its last frame."""
        while not done():
            message = await self.call.read()
            assert message is not grpc.aio.EOF, "the stream ended early"
            self.messages.append(message)
            for frame in message.frames:
                assert not self.ended(frame.request_id), f"a frame for {frame.request_id} after its end"
                if frame.WhichOneof("kind") == "failed":
                    self.failed[frame.request_id] = frame.failed
                else:
                    self.outcomes.setdefault(frame.request_id, self.outcome()).add(frame)

    async def until_ended(self, *request_ids: str) -> None:
        await self.until(lambda: all(self.ended(request_id) for request_id in request_ids))


async def draining(channel: grpc.aio.Channel) -> None:
    """Until the server on ``channel`` reports NOT_SERVING (its drain has begun), and a moment more."""
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
    async for reply in watch:
        if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
    watch.cancel()
    await asyncio.sleep(0.2)
