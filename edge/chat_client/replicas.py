"""The orchestrator replicas the edge reaches, each with its completion links, and which link a request
goes on: a chat's on its own replica (rendezvous hashing on the chat id, ``meshkit.replicas``), an
answer of no chat on the least busy link of the replicas up."""

from __future__ import annotations

from collections.abc import Container

import grpc

from chatmesh.chat.v1 import completion_link_pb2, completion_link_pb2_grpc
from meshkit.links import Link, LinkBroken, LinkMessages
from meshkit.replicas import Replica, Replicas

COMPLETION_LINK = LinkMessages.of(completion_link_pb2)


class OrchestratorReplica(Replica):
    """One orchestrator replica and ``count`` CompleteMany streams to it (``meshkit.links.Link``) that
    carry every request of the edge's: the events of every answer on one stream cross in one message a
    loop turn, where a call would cost a message per event each way, and the requests of one message
    start in one turn of the replica's loop, where its gRPC server takes one new call a turn."""

    def __init__(self, address: str, count: int) -> None:
        super().__init__(address)
        link_stub = completion_link_pb2_grpc.CompletionLinkServiceStub(self.channel)
        self.links = [
            Link(
                link_stub.CompleteMany,
                COMPLETION_LINK,
                f"the chat service at {address} (completion link {n})",
            )
            for n in range(count)
        ]

    def busy(self) -> bool:
        return any(link.requests for link in self.links)

    def least_busy_link(self) -> Link:
        return min(self.links, key=lambda link: link.requests)

    async def close(self, grace_s: float | None = None) -> None:
        for link in self.links:
            link.close()
        await super().close(grace_s)


def least_busy_link(
    replicas: Replicas[OrchestratorReplica], chat_id: str = "", failed_on: Container[str] = ()
) -> tuple[OrchestratorReplica, Link]:
    """The completion link with the fewest requests of the chat's replica (``chat_id``), or of the
    replicas up (no chat), but those a request ``failed_on`` (unless only they are left); raises
    ``unreachable()`` when no replica is known."""
    if not replicas.candidates(failed_on):
        failed_on = ()
    if chat_id:
        chosen = replicas.pick(chat_id, failed_on)
        chosen_replicas = [] if chosen is None else [chosen]
    else:
        chosen_replicas = replicas.candidates(failed_on)
    links = [(replica, link) for replica in chosen_replicas for link in replica.links]
    if not links:
        raise unreachable()
    return min(links, key=lambda pair: pair[1].requests)


def unreachable() -> LinkBroken:
    """No replica of the chat service is known: the failure of a link that cannot connect."""
    return LinkBroken(grpc.StatusCode.UNAVAILABLE, "no chat service replica is known")
