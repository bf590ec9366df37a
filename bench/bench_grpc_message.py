"""What one streamed gRPC message costs in Python, and how much coalescing tokens into frames could save.

A grpc.aio server (``meshkit.serving``, as every chatmesh service) streams ``GenerateTokens`` frames, one
request's frame a ``GenerateMany`` message (as a link carries one request's tokens), to a grpc.aio client in the same process, over loopback: the send side of one hop and the receive side of the
next. Reported: CPU per message (this process, gRPC's threads included) and per token, for frames of 1,
2, 4 and 8 tokens, with and without OpenTelemetry's gRPC interceptors (which ``meshkit.telemetry``
installs in every service). Every token crosses four such Python hops on its way to the edge.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_grpc_message.py [--messages 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from meshkit.launcher import free_port  # noqa: E402
from meshkit.serving import start_grpc_server  # noqa: E402

STREAMS = 10


class Frames(engine_pb2_grpc.EngineServiceServicer):
    """GenerateMany answers with ``per_stream`` messages of one frame of ``tokens_per_frame`` tokens (a null
    engine's shape, for one request)."""

    def __init__(self, per_stream: int, tokens_per_frame: int) -> None:
        self.per_stream, self.tokens_per_frame = per_stream, tokens_per_frame

    async def GenerateMany(self, request_iterator, context):
        width = self.tokens_per_frame
        for i in range(self.per_stream):
            tokens = engine_pb2.GenerateTokens(
                index=i * width, token_ids=list(range(1000, 1000 + width)), text=" token" * width
            )
            frame = engine_pb2.ResponseFrame(request_id="bench", tokens=tokens)
            yield engine_pb2.GenerateManyResponse(frames=[frame])


async def measure(messages: int, tokens_per_frame: int) -> tuple[float, float]:
    """CPU µs per message and per token, streaming ``messages`` frames over STREAMS streams."""
    frames = Frames(messages // STREAMS, tokens_per_frame)

    def add(server: grpc.aio.Server) -> list[str]:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(frames, server)
        return [engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name]

    handle = await start_grpc_server(add, free_port())
    start = engine_pb2.RequestFrame(request_id="bench", start=engine_pb2.GenerateStart(request_id="bench"))
    request = engine_pb2.GenerateManyRequest(frames=[start])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            received = 0

            async def one() -> None:
                nonlocal received
                async for _ in stub.GenerateMany(iter([request])):
                    received += 1

            await asyncio.gather(*(one() for _ in range(2)))  # warm-up: connection, first calls
            frames.per_stream = messages // STREAMS
            received, began = 0, time.process_time()
            await asyncio.gather(*(one() for _ in range(STREAMS)))
            spent = time.process_time() - began
    finally:
        await handle.server.stop(0)
    return spent * 1e6 / received, spent * 1e6 / (received * tokens_per_frame)


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000)
    args = parser.parse_args()
    print(
        f"{'interceptors':<13} {'tokens/frame':>12} {'µs/message':>10} {'µs/token':>9}  (server + client, one process)"
    )
    for traced in (False, True):
        if traced:
            from opentelemetry.instrumentation.grpc import (
                GrpcAioInstrumentorClient,
                GrpcAioInstrumentorServer,
            )

            GrpcAioInstrumentorServer().instrument()
            GrpcAioInstrumentorClient().instrument()
        for width in (1, 2, 4, 8):
            per_message, per_token = await measure(args.messages, width)
            name = "OpenTelemetry" if traced else "none"
            print(f"{name:<13} {width:>12} {per_message:>10.1f} {per_token:>9.1f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
