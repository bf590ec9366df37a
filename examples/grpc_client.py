"""A tiny ChatService client: gRPC through Envoy, as an internal service would call chatmesh.

    .venv/bin/python examples/grpc_client.py --target 127.0.0.1:8080 --token "$(make -s token)" "Hello!"

It creates a chat (or reuses --chat), sends the message, and prints the answer as it streams. The JWT goes
in the ``authorization`` metadata; Envoy verifies it and tells the orchestrator who is calling.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

import grpc

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.errors import retry_after_s
from chatmesh.identity import CHAT_ID_HEADER


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("message", help="what to say")
    parser.add_argument("--target", default="127.0.0.1:8080", help="Envoy's address host:port")
    parser.add_argument("--token", default=os.environ.get("TOKEN"), help="a JWT (default: $TOKEN)")
    parser.add_argument("--chat", default="", help="an existing chat id (default: a new chat)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline for the whole answer")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default: the server's; 0: greedy)",
    )
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("no token: pass --token or set TOKEN (make token USER=alice TIER=pro prints one)")

    auth = (("authorization", f"Bearer {args.token}"),)
    with grpc.insecure_channel(args.target) as channel:
        stub = chat_pb2_grpc.ChatServiceStub(channel)
        try:
            chat_id = (
                args.chat
                or stub.CreateChat(chat_pb2.CreateChatRequest(), metadata=auth, timeout=10).chat.chat_id
            )
            options = chat_pb2.GenerationOptions()
            if args.temperature is not None:
                options.temperature = args.temperature
            request = chat_pb2.SendMessageRequest(
                chat_id=chat_id, content=args.message, idempotency_key=str(uuid.uuid4()), options=options
            )
            # The chat id header lets Envoy keep this chat on one orchestrator replica.
            for response in stub.SendMessage(
                request, metadata=(*auth, (CHAT_ID_HEADER, chat_id)), timeout=args.timeout_s
            ):
                event = response.event
                kind = event.WhichOneof("kind")
                if kind == "delta":
                    print(event.delta.text, end="", flush=True)
                elif kind == "usage":
                    usage = event.usage
                    print(
                        f"\n[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]",
                        end="",
                    )
                elif kind == "done":
                    reason = chat_pb2.FinishReason.Name(event.done.finish_reason)
                    print(f"\n[{reason}; chat {chat_id}, message {event.done.assistant_message_id}]")
                elif kind == "error":
                    print(f"\n[error {event.error.code}: {event.error.message}]", file=sys.stderr)
                    return 1
        except grpc.RpcError as error:
            retry = retry_after_s(error)
            hint = f" (retry in {retry:.0f} s)" if retry else ""
            print(f"\n{error.code().name}: {error.details()}{hint}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
