"""A small EngineService client for tests: a request on a link (meshkit.links) that you can cancel, or
whose call you can drop, at will."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.router.v1 import router_pb2
from chatmesh.token_text import has_text_ends, token_pieces
from chatmesh.tokenizer import ChatMessage, ChatTokenizer
from meshkit.links import Link, LinkMessages

TIMEOUT_S = 30
ENGINE_LINK = LinkMessages.of(engine_pb2)


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


class Stream:
    """One request, on a link of its own (``meshkit.links``: a GenerateMany call, as the router reaches an
    engine), read frame by frame, so the test decides when to cancel it or drop its call. A refusal or
    failure raises its ServiceError."""

    timeout_s = TIMEOUT_S  # the longest wait for a frame

    def __init__(
        self, link: Link, start: engine_pb2.GenerateStart | router_pb2.GenerateStart, **fields: Any
    ) -> None:
        self.link, self.request_id = link, start.request_id
        self.feed = link.open(start, {}, **fields)
        self._arrived: deque[Any] = deque()

    @classmethod
    def start(cls, stub: engine_pb2_grpc.EngineServiceStub, start: engine_pb2.GenerateStart) -> Stream:
        return cls(Link(stub.GenerateMany, ENGINE_LINK, "the engine"), start)

    def send_cancel(self) -> None:
        self.link.cancel(self.request_id)

    def drop(self) -> None:
        """Cancels the call, as a client that went away: the peer stops the request's work."""
        self.link.close()

    async def read(self) -> Any:
        """The next frame (a ResponseFrame)."""
        while not self._arrived:
            frames = await asyncio.wait_for(self.feed.take(), self.timeout_s)
            assert frames, "the request ended early"
            self._arrived.extend(frames)
        return self._arrived.popleft()

    async def frames(self) -> AsyncIterator[Any]:
        """The frames not read yet, until the request ends (raising its error, if any); then lets go of
        the call."""
        try:
            while True:
                while self._arrived:
                    yield self._arrived.popleft()
                taken = await asyncio.wait_for(self.feed.take(), self.timeout_s)
                if not taken:
                    return
                self._arrived.extend(taken)
        finally:
            self.link.release(self.request_id)
            self.link.renew()  # half-closes the call: it has no other request

    async def rest(self) -> Outcome:
        """Reads until the request ends (raising its error, if any); what the frames said."""
        outcome = Outcome()
        async for frame in self.frames():
            outcome.add(frame)
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

    def add(self, frame: engine_pb2.ResponseFrame) -> None:
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
