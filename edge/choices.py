"""``n`` choices of one Chat Completion: one Complete per choice, each with a seed of its own, the
later ones started once the first has its first token, and their events merged in arrival order.

Choice 0 is the request as asked (its seed is the request's: ``n: 1`` answers as before); choice ``i``
samples with a seed derived from (seed, ``i``), so sampling stays a function of (seed, position) and a
choice never depends on ``n``. Without a seed each choice's run picks its own, as a run does.

The other choices start after the first's first token: by then its engine holds the prompt's KV blocks
in its prefix cache, and the router's KV-aware placement sends the siblings there, so the prompt is
prefilled once and each sibling computes only its last, partial block (its usage reports the rest as
cached). A choice the mesh refuses (a run slot, the budget) refuses the whole request, as its status.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from chatmesh.chat.v1 import chat_pb2
from edge.chat_client.caller import Caller
from edge.chat_client.client import ChatClient
from edge.chat_client.run_stream import RunStream

# OpenAI allows up to 128; each choice here is a run of its own (a run slot, admission, budget).
MAX_CHOICES = 8


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed``."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8, key=seed.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little")


def choice_request(request: chat_pb2.CompleteRequest, index: int) -> chat_pb2.CompleteRequest:
    """``request`` as choice ``index`` asks it."""
    if index == 0 or not request.options.HasField("seed"):
        return request
    child = chat_pb2.CompleteRequest()
    child.CopyFrom(request)
    child.options.seed = choice_seed(request.options.seed, index)
    return child


@dataclass(frozen=True)
class ChoiceEvent:
    """An event of choice ``index``'s run."""

    index: int
    event: chat_pb2.RunEvent

    def WhichOneof(self, group: str) -> str | None:  # read as a RunEvent's is
        return self.event.WhichOneof(group)


class Choices:
    """The open runs of a request's ``n`` choices, each past its opening answer."""

    def __init__(self, streams: list[RunStream], openings: list[chat_pb2.RunEvent]) -> None:
        self.streams = streams
        self.openings = openings

    @classmethod
    async def open(
        cls, orchestrator: ChatClient, request: chat_pb2.CompleteRequest, caller: Caller, n: int
    ) -> Choices:
        """Starts the ``n`` runs; raises ApiError (every run started is let go) if one is refused."""
        streams: list[RunStream] = []
        try:
            streams.append(orchestrator.stream("Complete", request, caller))
            openings = [await streams[0].opening_answer()]  # held until its first token
            streams += [
                orchestrator.stream("Complete", choice_request(request, i), caller) for i in range(1, n)
            ]
            openings += await asyncio.gather(*(stream.opening_answer() for stream in streams[1:]))
        except BaseException:
            for stream in streams:
                stream.detach()
            raise
        return cls(streams, list(openings))

    def first(self) -> ChoiceEvent:
        return ChoiceEvent(0, self.openings[0])

    async def rest(self) -> AsyncIterator[ChoiceEvent]:
        """Every event after ``first``, each choice's in its order, the choices' interleaved as they
        come; a failure of any choice raises ServiceError."""
        queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()

        async def follow(index: int) -> None:
            try:
                if index:
                    await queue.put(ChoiceEvent(index, self.openings[index]))
                async for event in self.streams[index].rest():
                    await queue.put(ChoiceEvent(index, event))
                await queue.put(None)
            except Exception as exc:  # the merged stream's reader raises it
                await queue.put(exc)

        tasks = [asyncio.create_task(follow(i)) for i in range(len(self.streams))]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    def detach(self) -> None:
        for stream in self.streams:
            stream.detach()
