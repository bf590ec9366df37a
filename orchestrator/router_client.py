"""The orchestrator's side of ``chatmesh.router.v1.RouterService``.

A generation is one bidirectional ``Generate`` stream: a ``start`` frame with the prompt's token ids
(tokenized once, here, with ``chatmesh.tokenizer``), then at most one ``cancel`` frame. The request
side stays open while the run lives: neither a half-close nor a dropped browser stops engine work;
only ``cancel()`` (CancelRun, output moderation) or ``abort()`` does.

Several router replicas sit behind one channel (``--router 10.0.0.1:50051,10.0.0.2:50051``, or a
``dns:///`` name with one address per replica): calls are spread round-robin over the routers that
are up, and a router that dies is skipped from then on. Every start frame carries a sampling seed, so
a generation whose router dies goes on through another one exactly (``continued``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Sequence

import grpc

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError, unavailable
from chatmesh.limits import Generation
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.streams import Outbox, ReadAhead
from chatmesh.tiers import tier_named
from chatmesh.token_text import coalesced
from meshkit.serving import CHANNEL_OPTIONS
from orchestrator.errors import from_rpc_error

log = logging.getLogger(__name__)

# How many routers one placement tries when they answer UNAVAILABLE (draining, or unreachable).
PLACEMENT_ATTEMPTS = 3


def start_frame(
    request_id: str,
    prompt: list[int],
    generation: Generation,
    tier: str,
    session_id: str,
    fingerprint: str,
    new_session: bool = False,
) -> router_pb2.GenerateStart:
    sampling = engine_pb2.SamplingParams(
        temperature=generation.temperature,
        top_p=generation.top_p,
        max_tokens=generation.max_tokens,
        stop=list(generation.stop),
    )
    # A seed of its own when the caller gave none: sampling is a function of (seed, position), so the
    # answer can be continued on another router or by another replica, token for token.
    sampling.seed = generation.seed if generation.seed is not None else secrets.randbits(63)
    return router_pb2.GenerateStart(
        request_id=request_id,
        model=generation.model,
        prompt_token_ids=prompt,
        sampling=sampling,
        tier=tier_named(tier).proto,
        session_id=session_id,
        tokenizer_fingerprint=fingerprint,
        new_session=new_session,
    )


def continued(start: router_pb2.GenerateStart, output_token_ids: Sequence[int]) -> router_pb2.GenerateStart:
    """``start`` again, resuming after ``output_token_ids`` (what the run has streamed so far), under a
    request id of its own (an earlier attempt may still be winding down on a router or engine)."""
    frame = router_pb2.GenerateStart()
    frame.CopyFrom(start)
    frame.request_id = f"{start.request_id.partition('~')[0]}~{secrets.token_hex(4)}"
    frame.resumed_output_token_ids[:] = output_token_ids
    return frame


def router_target(address: str) -> str:
    """A gRPC target for one router or several: ``host:port``, ``ip:port,ip:port,...`` (each replica
    named), or any gRPC target with a scheme (``dns:///router:50051``: one address per replica)."""
    if "," in address and ":/" not in address and not address.startswith(("ipv4:", "ipv6:")):
        return "ipv4:" + address
    return address


class GenerateStream:
    """One Generate call. ``open`` sends the start frame and waits for the router to place it.

    Frames go out through an ``Outbox``, so sending a cancel or half-closing never waits, and ``abort``
    ends the request side along with the call.
    """

    def __init__(self, stub: router_pb2_grpc.RouterServiceStub, deadline_s: float) -> None:
        self._outbox = Outbox(router_pb2.GenerateRequest(cancel=router_pb2.GenerateCancel()))
        self._call = stub.Generate(self._outbox.frames(), timeout=deadline_s)
        self.routed: router_pb2.GenerateRouted | None = None

    async def open(self, start: router_pb2.GenerateStart, placement_timeout_s: float) -> None:
        """Sends ``start`` and returns once the router placed the request; a refusal (shed under
        load, no engine for the model) raises ServiceError with the router's status and retry delay."""
        self._outbox.start(router_pb2.GenerateRequest(start=start))
        try:
            async with asyncio.timeout(placement_timeout_s):
                frame = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self.abort()
            raise from_rpc_error(exc, "the router") from exc
        except TimeoutError:
            self.abort()
            raise unavailable("the router did not place the request in time; retry", 1.0) from None
        if frame is grpc.aio.EOF or frame.WhichOneof("kind") != "routed":
            self.abort()
            raise unavailable("the router ended the stream before placing the request; retry", 1.0)
        self.routed = frame.routed

    async def frames(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The frames after the first placement, through ``finished`` (raises grpc.aio.AioRpcError).
        Token frames that arrived while the caller was busy come merged into one (``ReadAhead``).

        After ``finished`` it half-closes and reads the call's end, so the RPC completes now.
        """
        arriving = ReadAhead(self._call)
        try:
            while batch := await arriving.take():
                for frame in coalesced(batch):
                    kind = frame.WhichOneof("kind")
                    if kind == "routed":
                        self.routed = frame.routed
                    yield frame
                    if kind == "finished":
                        # The answer is complete: how the call itself ends no longer matters to it.
                        self.close()
                        await arriving.finish()
                        return
        finally:
            arriving.stop()

    def cancel(self) -> None:
        """Asks the router to stop and free the engine work; it answers with a final `finished`."""
        self._outbox.cancel()

    def close(self) -> None:
        """Half-closes the request side (once the stream has ended: a half-close is not a cancel)."""
        self._outbox.close()

    def abort(self) -> None:
        """Cancels the RPC itself: the router cancels the engine call at once."""
        self.close()
        self._call.cancel()


class RouterClient:
    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(
            router_target(address), options=(*CHANNEL_OPTIONS, ("grpc.lb_policy_name", "round_robin"))
        )
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def place(
        self, start: router_pb2.GenerateStart, deadline_s: float, placement_timeout_s: float
    ) -> GenerateStream:
        """A Generate stream (``deadline_s`` in all) whose ``start`` a router placed within
        ``placement_timeout_s``. A router that answers UNAVAILABLE (it is draining, or cannot be
        reached) is passed over for the next one round-robin picks, so a rolling restart of the
        routers refuses nothing; any other refusal is raised at once (ServiceError)."""
        attempt = 0
        while True:
            attempt += 1
            stream = GenerateStream(self._stub, deadline_s)
            try:
                await stream.open(start, placement_timeout_s)
                return stream
            except ServiceError as exc:
                router_down = exc.code == grpc.StatusCode.UNAVAILABLE and isinstance(
                    exc.__cause__, grpc.aio.AioRpcError
                )
                if not router_down or attempt == PLACEMENT_ATTEMPTS:
                    raise
                log.info(
                    "request %s: a router is unavailable (%s); trying another", start.request_id, exc.message
                )
            except BaseException:
                stream.abort()
                raise

    async def list_engines(self) -> list[router_pb2.EngineStatus]:
        try:
            reply = await self._stub.ListEngines(router_pb2.ListEnginesRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "the router") from exc
        return list(reply.engines)
