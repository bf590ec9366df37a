"""A ChatService client: gRPC through Envoy, as an internal service would call chatmesh.

    .venv/bin/python examples/grpc_client.py --target 127.0.0.1:8080 --token "$(make -s token)" "Hello!"

It creates a chat (or reuses --chat), sends the message and prints the answer as it streams. It does
what every client of a stored chat should (docs/api/grpc.md, "Retry and resume"):

- the JWT goes in the ``authorization`` metadata; ``x-chatmesh-chat-id`` keeps the chat on one replica;
- the send carries an idempotency key, so a send refused before it began (``UNAVAILABLE``, e.g. a
  draining replica) is sent again safely: the retry joins the same run, or starts it once;
- when the stream breaks mid-answer (``UNAVAILABLE``: its replica drained in a rolling deploy, or
  died), it resumes with ``StreamRun(run_id, after_seq)`` after the last event it printed, and the
  answer goes on with no gap and no repeat.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Iterable

import grpc

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.errors import retry_after_s
from chatmesh.identity import CHAT_ID_HEADER

# How long a broken stream is retried: a drained replica's runs are adopted within seconds, a dead
# one's after its heartbeats are missed (15 s by default).
RESUME_FOR_S = 60.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.25, 4.0


class Answer:
    """Prints a run's events and remembers where the stream is: the run and the last event seen."""

    def __init__(self, chat_id: str) -> None:
        self.chat_id = chat_id
        self.run_id = ""
        self.last_seq = 0
        self.error: chat_pb2.RunError | None = None

    def follow(self, events: Iterable[chat_pb2.RunEvent]) -> bool:
        """Prints ``events``; True once the run has ended (done or error)."""
        for event in events:
            self.last_seq = event.seq
            kind = event.WhichOneof("kind")
            if kind == "started":
                self.run_id = event.started.run_id
            elif kind == "delta":
                print(event.delta.text, end="", flush=True)
            elif kind == "usage":
                usage = event.usage
                print(
                    f"\n[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]", end=""
                )
            elif kind == "done":
                reason = chat_pb2.FinishReason.Name(event.done.finish_reason)
                print(f"\n[{reason}; chat {self.chat_id}, message {event.done.assistant_message_id}]")
                return True
            elif kind == "error":
                self.error = event.error
                return True
        return False


def answer(
    stub: chat_pb2_grpc.ChatServiceStub, request: chat_pb2.SendMessageRequest, auth, timeout_s: float
) -> Answer:
    """Sends ``request`` and follows its run to the end, resuming the stream whenever it breaks."""
    metadata = (*auth, (CHAT_ID_HEADER, request.chat_id))
    run = Answer(request.chat_id)
    deadline = time.monotonic() + timeout_s
    backoff, broken_since = FIRST_BACKOFF_S, None
    while True:
        remaining, seen = deadline - time.monotonic(), run.last_seq
        try:
            if not run.run_id:  # not started yet: (re)send; the idempotency key makes it safe
                stream = stub.SendMessage(request, metadata=metadata, timeout=remaining)
                ended = run.follow(response.event for response in stream)
            else:
                resume = chat_pb2.StreamRunRequest(run_id=run.run_id, after_seq=run.last_seq)
                stream = stub.StreamRun(resume, metadata=metadata, timeout=remaining)
                ended = run.follow(response.event for response in stream)
            if ended:
                return run
            raise RuntimeError("the stream ended before its run did")  # a server never does this
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            if run.last_seq > seen:  # it had made progress: a new break
                backoff, broken_since = FIRST_BACKOFF_S, None
            broken_since = broken_since or time.monotonic()
            if time.monotonic() - broken_since > RESUME_FOR_S:
                raise
            where = f"resuming run {run.run_id} after event {run.last_seq}" if run.run_id else "sending again"
            print(f"\n[stream broke ({error.details()}); {where}]", file=sys.stderr, flush=True)
            time.sleep(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("message", help="what to say")
    parser.add_argument("--target", default="127.0.0.1:8080", help="Envoy's address host:port")
    parser.add_argument("--token", default=os.environ.get("TOKEN"), help="a JWT (default: $TOKEN)")
    parser.add_argument("--chat", default="", help="an existing chat id (default: a new chat)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline for the whole answer")
    parser.add_argument("--max-tokens", type=int, default=0, help="longest answer (default: the server's)")
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
            options = chat_pb2.GenerationOptions(max_tokens=args.max_tokens)
            if args.temperature is not None:
                options.temperature = args.temperature
            request = chat_pb2.SendMessageRequest(
                chat_id=chat_id, content=args.message, idempotency_key=str(uuid.uuid4()), options=options
            )
            run = answer(stub, request, auth, args.timeout_s)
        except grpc.RpcError as error:
            retry = retry_after_s(error)
            hint = f" (retry in {retry:.0f} s)" if retry else ""
            print(f"\n{error.code().name}: {error.details()}{hint}", file=sys.stderr)
            return 1
    if run.error is not None:
        print(f"\n[error {run.error.code}: {run.error.message}]", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
