"""The edge's ChatService client (``ChatClient``): the orchestrator replicas ``target`` names, each reached
by the edge itself, and every call and answer stream on their completion links (``replicas``): unary
calls (``unary``) and run-event streams (``linked_run``, read by ``run_stream``)."""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError
from chatmesh.linked_calls import linked_start
from edge.chat_client.caller import Caller
from edge.chat_client.linked_run import LinkedRun
from edge.chat_client.replicas import OrchestratorReplica
from edge.chat_client.run_stream import RunStream
from edge.chat_client.unary import unary
from edge.drain import Drain
from edge.errors import from_service_error
from meshkit.replicas import Replicas


class ChatClient:
    """A ChatService client over the orchestrator replicas ``target`` names (a list, or a ``dns:///``
    name with one address per replica: a headless Service), ``links`` CompleteMany streams to each (one
    channel each: HTTP/2 multiplexes them). A chat's calls and streams go to one replica while it is up
    (rendezvous hashing on the chat id), a Complete to the least busy link of those up; a replica down or
    draining (its health says so first) is passed over. ``start`` before use (it resolves the names once).

    Unary calls carry a deadline. Streams carry a (long) deadline too, and are read event by event; the
    edge never buffers a run."""

    def __init__(
        self,
        target: str,
        *,
        links: int,
        unary_timeout_s: float,
        stream_timeout_s: float,
        start_timeout_s: float,
        drain: Drain,
    ) -> None:
        self.drain = drain
        self.unary_timeout_s = unary_timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.start_timeout_s = start_timeout_s
        self._replicas = Replicas(
            target, lambda address: OrchestratorReplica(address, links), leaving_grace_s=stream_timeout_s
        )

    async def start(self) -> None:
        await self._replicas.ready()

    async def close(self) -> None:
        await self._replicas.close()

    async def unary(self, method: str, request: Message, caller: Caller) -> Any:
        """Calls ``method`` with a deadline and returns its response message; a failure raises the
        matching ApiError (``unary.unary``)."""
        return await unary(self._replicas, method, request, caller, self.unary_timeout_s)

    def stream(self, method: str, request: Message, caller: Caller) -> RunStream:
        """The run-event stream of ``method`` (SendMessage, RegenerateMessage, StreamRun, Complete); a
        stored chat's is attached again after its last event when it breaks (``RunStream.rest``)."""
        try:
            linked = self._linked_run(method, request, caller)
        except ServiceError as exc:
            raise from_service_error(exc) from exc
        if method == "Complete":
            return RunStream(linked, self.drain)

        def reattach(run_id: str, after_seq: int) -> LinkedRun:
            attach = chat_pb2.StreamRunRequest(
                run_id=run_id, after_seq=after_seq, merge_deltas=getattr(request, "merge_deltas", False)
            )
            return self._linked_run("StreamRun", attach, caller)

        if isinstance(request, chat_pb2.StreamRunRequest):
            return RunStream(linked, self.drain, reattach, request.run_id, request.after_seq)
        return RunStream(linked, self.drain, reattach)

    def _linked_run(self, method: str, request: Message, caller: Caller) -> LinkedRun:
        return LinkedRun(
            self._replicas,
            linked_start(method, caller.authorization, request),
            caller,
            start_timeout_s=self.start_timeout_s,
            stream_timeout_s=self.stream_timeout_s,
        )
