"""A small RouterService client for tests: a Generate stream you can cancel or half-close at will, and
what its frames said (checked for the stream contract as they arrive)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from chatmesh.engine.v1 import engine_pb2
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.token_text import has_text_ends, token_pieces

TIMEOUT_S = 60
_ids = itertools.count()


def start_frame(
    prompt: list[int], max_tokens: int = 16, request_id: str = "", **fields: object
) -> router_pb2.GenerateStart:
    return router_pb2.GenerateStart(
        request_id=request_id or f"test-{next(_ids)}",
        prompt_token_ids=prompt,
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )


@dataclass
class Outcome:
    routed: list[router_pb2.GenerateRouted] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    pieces: list[tuple[int, str]] = field(default_factory=list)  # each token and the text it released
    finished: engine_pb2.GenerateFinished | None = None
    tokens_after_routed: list[int] = field(default_factory=list)  # tokens received under each placement

    @property
    def engine_id(self) -> str:
        return self.routed[-1].engine_id

    def add(self, frame: router_pb2.GenerateResponse) -> None:
        kind = frame.WhichOneof("kind")
        assert self.finished is None, "nothing may follow `finished`"
        if kind == "routed":
            assert frame.routed.attempt == len(self.routed) + 1, "attempts count up from 1"
            self.routed.append(frame.routed)
            self.tokens_after_routed.append(0)
        elif kind == "tokens":
            assert self.routed, "`routed` comes before any token"
            assert frame.tokens.index == len(self.token_ids), (
                "token frames must be contiguous across failovers"
            )
            assert has_text_ends(frame.tokens), "engines' per-token text ends reach the client intact"
            self.token_ids += frame.tokens.token_ids
            self.text += frame.tokens.text
            self.pieces += token_pieces(frame.tokens)
            self.tokens_after_routed[-1] += len(frame.tokens.token_ids)
        else:
            assert kind == "finished", f"unexpected {kind} frame"
            self.finished = frame.finished
            self.text += frame.finished.text


@dataclass
class Stream:
    """One Generate call; frames go out through a queue so the test decides when to cancel or half-close."""

    call: grpc.aio.StreamStreamCall
    outbox: asyncio.Queue
    outcome: Outcome = field(default_factory=Outcome)

    @classmethod
    def start(cls, stub: router_pb2_grpc.RouterServiceStub, start: router_pb2.GenerateStart) -> Stream:
        outbox: asyncio.Queue = asyncio.Queue()
        outbox.put_nowait(router_pb2.GenerateRequest(start=start))

        async def frames() -> AsyncIterator[router_pb2.GenerateRequest]:
            while (frame := await outbox.get()) is not None:
                yield frame

        return cls(stub.Generate(frames(), timeout=TIMEOUT_S), outbox)

    def send_cancel(self) -> None:
        self.outbox.put_nowait(router_pb2.GenerateRequest(cancel=router_pb2.GenerateCancel()))

    def half_close(self) -> None:
        self.outbox.put_nowait(None)

    async def read(self) -> router_pb2.GenerateResponse:
        frame = await self.call.read()
        assert frame is not grpc.aio.EOF, "the stream ended early"
        self.outcome.add(frame)
        return frame

    async def until(self, kind: str) -> router_pb2.GenerateResponse:
        while (frame := await self.read()).WhichOneof("kind") != kind:
            pass
        return frame

    async def rest(self) -> Outcome:
        """Reads until the stream ends (raising its error status, if any)."""
        try:
            while (frame := await self.call.read()) is not grpc.aio.EOF:
                self.outcome.add(frame)
        finally:
            self.half_close()
        return self.outcome


async def generate(stub: router_pb2_grpc.RouterServiceStub, start: router_pb2.GenerateStart) -> Outcome:
    return await Stream.start(stub, start).rest()


async def list_engines(stub: router_pb2_grpc.RouterServiceStub) -> dict[str, router_pb2.EngineStatus]:
    reply = await stub.ListEngines(router_pb2.ListEnginesRequest(), timeout=TIMEOUT_S)
    return {engine.engine_id: engine for engine in reply.engines}
