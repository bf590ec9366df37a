"""A small RouterService client for tests: a request on a link (meshkit.links) that you can cancel, or
whose call you can drop, at will, and what its frames said (checked for the contract as they arrive)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from chatmesh.engine.v1 import engine_pb2
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.token_text import has_text_ends, token_pieces
from meshkit.links import Link, LinkMessages
from tests.engine import service_client

TIMEOUT_S = 60
ROUTER_LINK = LinkMessages.of(router_pb2)
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

    def add(self, frame: router_pb2.ResponseFrame) -> None:
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


class Stream(service_client.Stream):
    """One request on a link of its own to the router (as the orchestrator reaches it), with its deadline
    in its start frame; what its frames said so far is ``outcome``."""

    timeout_s = TIMEOUT_S

    def __init__(self, link: Link, start: router_pb2.GenerateStart) -> None:
        super().__init__(link, start, timeout_ms=TIMEOUT_S * 1000)
        self.outcome = Outcome()

    @classmethod
    def start(cls, stub: router_pb2_grpc.RouterServiceStub, start: router_pb2.GenerateStart) -> Stream:
        return cls(Link(stub.GenerateMany, ROUTER_LINK, "the router"), start)

    async def read(self) -> router_pb2.ResponseFrame:
        frame = await super().read()
        self.outcome.add(frame)
        return frame

    async def until(self, kind: str) -> router_pb2.ResponseFrame:
        while (frame := await self.read()).WhichOneof("kind") != kind:
            pass
        return frame

    async def rest(self) -> Outcome:
        """Reads until the request ends (raising its error, if any)."""
        async for frame in self.frames():
            self.outcome.add(frame)
        return self.outcome


async def generate(stub: router_pb2_grpc.RouterServiceStub, start: router_pb2.GenerateStart) -> Outcome:
    return await Stream.start(stub, start).rest()


async def list_engines(stub: router_pb2_grpc.RouterServiceStub) -> dict[str, router_pb2.EngineStatus]:
    reply = await stub.ListEngines(router_pb2.ListEnginesRequest(), timeout=TIMEOUT_S)
    return {engine.engine_id: engine for engine in reply.engines}
