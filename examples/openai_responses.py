"""OpenAI's Responses API on chatmesh's durable runs, with the official SDK: a stored response streamed,
the stream dropped part way, and resumed after the last event seen; then a follow-up that continues
the same conversation.

    .venv/bin/python examples/openai_responses.py --token "$(make -s token)" "Tell me about Paris."

A stored response is a run of a chat: it goes on when its client leaves, and any replica serves it
again, so a dropped stream loses nothing (docs/api/openai.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import openai


def text_of(events: list) -> str:
    return "".join(event.delta for event in events if event.type == "response.output_text.delta")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("message", help="what to ask")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="Envoy's /v1")
    parser.add_argument("--token", default=os.environ.get("TOKEN"), help="a JWT (default: $TOKEN)")
    parser.add_argument("--max-output-tokens", type=int, default=64, help="longest answer")
    parser.add_argument("--drop-after", type=int, default=6, help="events to read before dropping the stream")
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("no token: pass --token or set TOKEN (make token USER=alice TIER=pro prints one)")

    client = openai.OpenAI(base_url=args.base_url, api_key=args.token, max_retries=3)
    try:
        stream = client.responses.create(
            input=args.message, max_output_tokens=args.max_output_tokens, stream=True
        )
        seen = []
        for event in stream:
            seen.append(event)
            if len(seen) == args.drop_after:
                break
        stream.close()  # the connection is gone; the response is not
        response_id, last = seen[0].response.id, seen[-1].sequence_number
        print(text_of(seen), end="", flush=True)
        print(f"\n[stream dropped after event {last}; resuming {response_id}]")

        rest = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
        print(text_of(rest))
        final = rest[-1].response
        print(f"[{final.status}; {final.usage.output_tokens} output tokens]")

        later = client.responses.create(
            input="Say that again in five words.", previous_response_id=response_id, max_output_tokens=16
        )
        print(f"follow-up: {later.output_text}")
    except openai.APIStatusError as error:
        print(f"{error.status_code}: {error.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
