"""``python -m engine``: one inference engine replica (EngineService)."""

from __future__ import annotations

import asyncio

import grpc

from chatmesh import serving, telemetry
from chatmesh.config import ServiceArgs
from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc


def parse_args(argv: list[str] | None = None):
    args = ServiceArgs("engine", "Serves a model with a paged KV cache and continuous batching.")
    args.add_server_flags(port=50061)
    args.add("engine-id", "engine-0", "name of this replica in logs and metrics")
    args.add("model", "", "model path (GGUF file or Hugging Face directory); empty: the bundled SmolLM2")
    args.add("backend", "cpu", "model runner: cpu | null | cuda | tensorrt_llm | triton")
    return args.parse(argv)


def add_services(server: grpc.aio.Server) -> list[str]:
    engine_pb2_grpc.add_EngineServiceServicer_to_server(engine_pb2_grpc.EngineServiceServicer(), server)
    return [engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    telemetry.setup("engine")
    asyncio.run(serving.serve("engine", args, add_services))


if __name__ == "__main__":
    main()
