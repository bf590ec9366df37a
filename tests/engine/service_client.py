"""A small EngineService client for tests: a Generate stream you can cancel or half-close at will."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.token_text import has_text_ends, token_pieces
from chatmesh.tokenizer import ChatMessage, ChatTokenizer

TIMEOUT_S = 30


def capital_question(tokenizer: ChatTokenizer) -> list[int]:
    """The prompt the service tests send: one user turn, chat template applied. Not the bare question,
    whose first token is a near-tie (docs/benchmarks/engine.md, "int8 and greedy answers"): every kernel set answers Paris."""
    return tokenizer.encode_chat(
        [ChatMessage("user", "What is the capital of France? Answer in one sentence.")]
    )


@contextlib.asynccontextmanager
async def engine_stub(address: str) -> AsyncIterator[engine_pb2_grpc.EngineServiceStub]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)


def start_frame(
    request_id: str, prompt: list[int], max_tokens: int = 16, **fields: object
) -> engine_pb2.GenerateStart:
    sampling = engine_pb2.SamplingParams(max_tokens=max_tokens)
    return engine_pb2.GenerateStart(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling, **fields
    )


@dataclass
class Stream:
    """One Generate call; frames go out through a queue so the test decides when to cancel or half-close."""

    call: grpc.aio.StreamStreamCall
    outbox: asyncio.Queue

    @classmethod
    def open(cls, stub: engine_pb2_grpc.EngineServiceStub, *first: engine_pb2.GenerateRequest) -> Stream:
        outbox: asyncio.Queue = asyncio.Queue()
        for frame in first:
            outbox.put_nowait(frame)

        async def frames() -> AsyncIterator[engine_pb2.GenerateRequest]:
            while (frame := await outbox.get()) is not None:
                yield frame

        return cls(stub.Generate(frames(), timeout=TIMEOUT_S), outbox)

    @classmethod
    def start(cls, stub: engine_pb2_grpc.EngineServiceStub, start: engine_pb2.GenerateStart) -> Stream:
        return cls.open(stub, engine_pb2.GenerateRequest(start=start))

    def send_cancel(self) -> None:
        self.outbox.put_nowait(engine_pb2.GenerateRequest(cancel=engine_pb2.GenerateCancel()))

    def half_close(self) -> None:
        self.outbox.put_nowait(None)

    async def read(self) -> engine_pb2.GenerateResponse:
        frame = await self.call.read()
        assert frame is not grpc.aio.EOF, "the stream ended early"
        return frame

    async def rest(self) -> Outcome:
        """Reads until the stream ends (raising its error status, if any); what the frames said."""
        outcome = Outcome()
        try:
            while (frame := await self.call.read()) is not grpc.aio.EOF:
                outcome.add(frame)
        finally:
            self.half_close()  # lets the request generator end, so the call can close cleanly
        return outcome


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    pieces: list[tuple[int, str]] = field(default_factory=list)  # each token and the text it released
    logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)  # when the request asked
    frames: int = 0
    finished: engine_pb2.GenerateFinished | None = None
    first_index: int | None = None

    def add(self, frame: engine_pb2.GenerateResponse) -> None:
        kind = frame.WhichOneof("kind")
        assert self.finished is None, "nothing may follow `finished`"
        if kind == "accepted":
            assert self.first_index is None, "`accepted` comes first"
        elif kind == "tokens":
            if self.first_index is None:
                self.first_index = frame.tokens.index
            assert frame.tokens.index == self.first_index + len(self.token_ids), (
                "token frames must be contiguous"
            )
            assert has_text_ends(frame.tokens), "every token frame splits into per-token pieces"
            self.token_ids += frame.tokens.token_ids
            self.text += frame.tokens.text
            self.pieces += token_pieces(frame.tokens)
            self.logprobs += frame.tokens.logprobs
            self.frames += 1
        else:
            assert kind == "finished", f"unexpected {kind} frame"
            self.finished = frame.finished
            self.text += frame.finished.text


async def wait_until(
    check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)
