"""``python -m orchestrator``: the ChatService (history, prompt assembly, budgets, runs)."""

from __future__ import annotations

import asyncio

import grpc

from chatmesh import serving, telemetry
from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.config import ServiceArgs


def parse_args(argv: list[str] | None = None):
    args = ServiceArgs("orchestrator", "Serves ChatService: chats, messages and streamed answers.")
    args.add_server_flags(port=50050)
    args.add("router", "127.0.0.1:50051", "router address host:port")
    args.add_list("cassandra", ["127.0.0.1:9042"], "Cassandra contact point host:port (repeatable)")
    return args.parse(argv)


def add_services(server: grpc.aio.Server) -> list[str]:
    chat_pb2_grpc.add_ChatServiceServicer_to_server(chat_pb2_grpc.ChatServiceServicer(), server)
    return [chat_pb2.DESCRIPTOR.services_by_name["ChatService"].full_name]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    telemetry.setup("orchestrator")
    asyncio.run(serving.serve("orchestrator", args, add_services))


if __name__ == "__main__":
    main()
